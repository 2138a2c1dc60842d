"""Loss curves of training runs, against steps and against tokens seen.

    python scripts/plot.py metrics.jsonl -o curves.png
    python scripts/plot.py a.jsonl b.jsonl --label 'ZeRO-1' --label 'ZeRO-3' -o curves.png

Reads the JSON-lines metrics files scripts/train.py writes (--metrics-out)
and draws the training loss (lines) and validation loss (dots on dashed
lines) of every run on two panels: against the step, and against the tokens
seen. Each run is labelled by its file name, or by --label (one per file).
Values written as null (non-finite: a skipped step) are left out.

The records hold no token count of their own: each step's tokens are its
`tokens_per_s` times its `step_time_s`, summed over the steps before it
(zero_jax/runtime/metrics.py reads the records).

Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zero_jax.runtime import metrics


class PlotError(ValueError):
    """An argument that cannot be plotted (a bad metrics file is metrics.RecordsError)."""


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
        tokens = metrics.tokens_seen(records)
        for key, style in (("loss", dict(lw=1.2)),
                           ("val_loss", dict(ls="--", marker="o", ms=4, lw=1))):
            steps, seen, values = metrics.series(records, tokens, key)
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
        runs = [(name, metrics.read_records(path)) for name, path in zip(names, args.files)]
        draw(runs, args.out)
    except (PlotError, metrics.RecordsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(runs)} run(s), "
          f"{sum(len(records) for _, records in runs)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
