"""What a train step moves without computing, read from its compiled HLO.

    python scripts/hlo_moves.py --devices 2 --mesh fsdp=2 [any train.py flag] \
        [--top 20] [--json] [--dump step.hlo]
    python scripts/hlo_moves.py --hlo step.hlo     # a step compiled earlier (--dump)

Compiles the run's train step as scripts/train.py does (nothing runs) and
counts, per device and per step, the copies, transposes, zero-fills, slices
and in-place updates it executes, loop bodies times their trip counts, with
the bytes each writes (zero_jax/analysis/moves.py). Prints the totals by
kind, then the largest moves with the JAX operation each came from. `--dump`
keeps the HLO text, so that a step compiled from another commit's tree can be
compared with this one's: the counts are exact, not timed, and repeat on any
machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zero_jax.config import flags  # noqa: E402
from zero_jax.analysis import moves  # noqa: E402
from zero_jax.runtime import cpu  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML run config; flags override it")
    parser.add_argument("--hlo", help="read this compiled HLO text instead of compiling")
    parser.add_argument("--dump", help="write the compiled HLO text here")
    parser.add_argument("--top", type=int, default=20, help="moves listed (default 20)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    cpu.add_devices_flag(parser)
    flags.add_flags(parser)
    return parser.parse_args(argv)


def compiled_text(args) -> str:
    """The optimised HLO of the run's train step, compiled here."""
    cpu.simulate(args.devices)
    import models
    from zero_jax import job as job_lib
    from zero_jax.data import corpus as corpus_lib

    cfg = flags.from_args(args, args.config)
    build, _ = models.for_run(cfg.model, corpus_lib.load(cfg.data.source).vocab_size)
    return job_lib.prepare(cfg, build).lower_train_step().compile().as_text()


def main(argv=None) -> int:
    args = parse(argv)
    text = Path(args.hlo).read_text() if args.hlo else compiled_text(args)
    if args.dump:
        Path(args.dump).write_text(text)
    found = moves.census(text)
    totals = moves.by_kind(found)
    if args.json:
        print(json.dumps({"by_kind": {k: {"ops_per_step": n, "bytes_per_step": b}
                                      for k, (n, b) in totals.items()},
                          "moves": [vars(m) for m in found[:args.top]]}, indent=1))
        return 0
    print("moves per device per step (ops executed, MiB written)")
    for kind, (n, b) in totals.items():
        print(f"  {kind:<24}{n:>6}{b / 2**20:>10.2f}")
    print(f"  {'total':<24}{sum(n for n, _ in totals.values()):>6}"
          f"{sum(b for _, b in totals.values()) / 2**20:>10.2f}")
    print(f"\n{'instruction':<42}{'kind':<22}{'times':>6}{'MiB':>8}  JAX op")
    for m in found[:args.top]:
        print(f"{m.name[:41]:<42}{m.kind:<22}{m.times:>6}{m.bytes / 2**20:>8.2f}  {m.op_name[-60:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
