"""Loss curves of training runs, against steps and against tokens seen.

    python scripts/plot.py metrics.jsonl -o curves.png
    python scripts/plot.py a.jsonl b.jsonl --label 'ZeRO-1' --label 'ZeRO-3' -o curves.png

Reads the JSON-lines metrics files scripts/train.py writes (--metrics-out)
and draws the training loss (lines) and validation loss (dots on dashed
lines) of every run on two panels: against the step, and against the tokens
seen. Each run is labelled by its file name, or by --label (one per file).
Values written as null (non-finite: a skipped step) are left out.

The records hold no token count of their own: each step's tokens are its
`tokens_per_s` times its `step_time_s` (zero_jax/loop.py divides the step's
tokens by that same time), summed over the steps before it.

Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


class PlotError(ValueError):
    """A metrics file or an argument that cannot be plotted."""


def read_records(path: Path) -> list[dict]:
    """The records of one metrics file. A last line cut short (a run that
    crashed while writing it) is dropped; a bad line elsewhere is an error."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise PlotError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlotError(f"{path}: cannot read it ({e})") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                break
            raise PlotError(f"{path}:{number}: not a JSON object; is this a --metrics-out file?") from None
        if not isinstance(record, dict) or "step" not in record:
            raise PlotError(f"{path}:{number}: a record without a 'step'; is this a --metrics-out file?")
        records.append(record)
    if not records:
        raise PlotError(f"{path}: no records (an empty metrics file)")
    return records


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def tokens_seen(records: list[dict]) -> list[float]:
    """Tokens seen by the end of each record's step. A step whose rate or time
    is null counts the tokens of the last step that had both: a run's steps
    all see the same batch shape."""
    total, per_step, out = 0.0, 0.0, []
    for r in records:
        rate, seconds = r.get("tokens_per_s"), r.get("step_time_s")
        if finite(rate) and finite(seconds):
            per_step = rate * seconds
        total += per_step
        out.append(total)
    return out


def series(records: list[dict], tokens: list[float], key: str
           ) -> tuple[list[float], list[float], list[float]]:
    """(steps, tokens, values) of `key`, where the record has a finite value."""
    kept = [(r["step"], t, r[key]) for r, t in zip(records, tokens) if finite(r.get(key))]
    return tuple(map(list, zip(*kept))) if kept else ([], [], [])


def labels(paths: list[Path], given: list[str] | None) -> list[str]:
    """--label values, else file names (the paths as given where two names are the same)."""
    if given:
        if len(given) != len(paths):
            raise PlotError(f"--label given {len(given)} time(s) for {len(paths)} file(s); "
                            "give one per file, in the same order")
        return given
    names = [p.name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def draw(runs: list[tuple[str, list[dict]]], out: Path) -> None:
    """Two panels, loss against step and against tokens, every run overlaid."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, (label, records) in enumerate(runs):
        color = f"C{i % 10}"
        tokens = tokens_seen(records)
        for key, style in (("loss", dict(lw=1.2)),
                           ("val_loss", dict(ls="--", marker="o", ms=4, lw=1))):
            steps, seen, values = series(records, tokens, key)
            if not values:  # no validation in this run: no empty legend entry
                continue
            name = label if key == "loss" else f"{label} (validation)"
            by_step.plot(steps, values, color=color, label=name, **style)
            by_tokens.plot(seen, values, color=color, **style)
    by_step.set(xlabel="step", ylabel="loss (nats per token)", title="loss against step")
    by_tokens.set(xlabel="tokens seen", title="loss against tokens")
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_tokens.xaxis.set_major_formatter(EngFormatter())
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise PlotError(f"-o {out}: cannot write it ({e.strerror or e})") from None
    except ValueError as e:  # a suffix matplotlib has no writer for
        raise PlotError(f"-o {out}: {e}") from None
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="RUN.jsonl",
                        help="metrics files written by scripts/train.py --metrics-out")
    parser.add_argument("-o", "--out", type=Path, default=Path("curves.png"),
                        help="image to write (default curves.png; the suffix picks the format)")
    parser.add_argument("--label", action="append",
                        help="a run's label, once per file in order (default: the file names)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401 - an optional dependency: say how to get it
    except ImportError:
        print("error: scripts/plot.py needs matplotlib: pip install -e '.[plot]'", file=sys.stderr)
        return 2
    try:
        names = labels(args.files, args.label)
        runs = [(name, read_records(path)) for name, path in zip(names, args.files)]
        draw(runs, args.out)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(runs)} run(s), "
          f"{sum(len(records) for _, records in runs)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
