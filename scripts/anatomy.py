"""Where a train step spends its time: profile a few steps, sum by op.

    python scripts/anatomy.py --devices 2 --mesh fsdp=2 [any zero-jax train flag] \
        [--trace-steps 6] [--top 25] [--json]

Compiles the run's train step as `zero-jax train` does, runs two warm-up
steps, traces the next `--trace-steps` with jax.profiler, and sums each
compiled op's time by category (zero_jax/report/anatomy.py): matmuls,
attention, the loss head, norms and activations, the scan's slicing and
stacking, collectives and the optimizer update; forward and backward apart.
Prints the categories, then the top ops.

Times are device-thread milliseconds per step, summed over the devices: on
CPU the simulated devices share the cores, so the step's wall time is about
this sum divided by the cores in use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zero_jax import config as config_lib  # noqa: E402
from zero_jax.config import flags  # noqa: E402
from zero_jax.report import anatomy  # noqa: E402
from zero_jax.runtime import cpu  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML run config; flags override it")
    parser.add_argument("--top", type=int, default=25, help="ops listed (default 25)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--trace-steps", type=int, default=6, help="steps traced (default 6)")
    cpu.add_devices_flag(parser)
    flags.add_flags(parser)
    args = parser.parse_args(argv)
    return flags.from_args(args, args.config), args


def main(argv=None) -> int:
    try:
        cfg, args = parse(argv)
        cpu.simulate(args.devices)
        job, corpus = anatomy.prepare(cfg)
    except (config_lib.ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = anatomy.profile(job, corpus, args.trace_steps, args.top)
    print(json.dumps(report, indent=1) if args.json else
          "\n".join(anatomy.rows(report, args.trace_steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
