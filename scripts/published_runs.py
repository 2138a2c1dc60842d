"""The planner against published training runs: the table in docs/planning.md.

    python scripts/published_runs.py            # print the table
    python scripts/published_runs.py --write    # and write it into docs/planning.md

Each run of zero_jax/planner/published.py planned at its published layout
(about 15 s on one core); the table is what tests/test_planner.py checks
the docs against, and every ratio must be within 15%.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zero_jax.planner import published

DOCS = Path(__file__).resolve().parent.parent / "docs" / "planning.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the table into {DOCS.name}")
    args = parser.parse_args(argv)
    predictions = [published.predict(run) for run in published.RUNS]
    table = published.table(predictions)
    print(table)
    if args.write:
        DOCS.write_text(published.with_table(DOCS.read_text(), table))
        print(f"written into {DOCS}")
    worst = max(predictions, key=lambda p: abs(p.ratio - 1))
    print(f"worst: {worst.run.name} at {worst.ratio:.2f} of its published figure")
    return 0 if abs(worst.ratio - 1) <= published.LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
