"""Throughput, MFU and compiled memory of a fixed suite of training runs.

    zero-jax bench --suite cpu                  # 8 simulated CPU devices: under 5 minutes on 2 cores
    zero-jax bench --suite gpu-1                # one GPU: bf16, the largest models that fit
    zero-jax bench --suite cpu --cases 'gpt-tiny/dp2-*' --steps 5 --json-out b.json
    zero-jax bench --suite gpu-1 --dry-run      # the gpu-1 selection on CPU, tiny models

Each case is a run config (model, mesh, ZeRO stage, precision, remat,
offload) prepared as `zero-jax train` prepares it
(zero_jax/bench/suites.py). Its train step is compiled ahead of time (timed:
lower + compile), its bytes per device read from the compiled program's
memory_analysis(), its state initialised, and then it runs --warmup and
--steps steps on one synthetic batch, waiting for each
(zero_jax/bench/measure.py). Reported: tokens/s and model and hardware
FLOP/s per device, MFU and HFU at the median step time (the peak and its
source), the step times' median, quartiles and range, the compile time and
the compiled bytes per device. A case that fails (refused by the config
checks, out of memory) is recorded with its error and the suite goes on. The
table is printed as cases finish, and --json-out is rewritten after each.

--suite gpu-1 climbs ladders of models, smallest first, once per offload mode
(none; the optimizer state in host memory; and at ZeRO-3 the parameters too).
A model whose compiled bytes exceed the device's memory (its bytes_limit, or
--memory-limit), or that runs out of memory, is recorded as "does not fit"
and ends its ladder: the models above it are not tried. JAX's allocator takes
75% of a GPU unless told otherwise: XLA_PYTHON_CLIENT_MEM_FRACTION=.95 lets
larger models fit. Offloaded states that would not fit in the host's memory
end a ladder before compiling. --dry-run climbs the same ladders with tiny
shapes on CPU under a small limit.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax

from zero_jax.bench import measure, suites
from zero_jax.runtime import cpu

COLUMNS = (("case", 34), ("params", 9), ("tokens/s", 11), ("MFU", 7), ("HFU", 7),
           ("step ms", 9), ("[min-max]", 15), ("compile s", 10), ("MiB/dev", 9))


def header() -> str:
    return "".join(f"{name:<{w}}" if i == 0 else f"{name:>{w}}" for i, (name, w) in enumerate(COLUMNS))


def row(r: dict) -> str:
    """One case as a table line; a failed case's error in place of figures."""
    name = f"{r['name']:<{COLUMNS[0][1]}}"
    if r["status"] != "ok":
        return f"{name}{r['status']}: {r.get('error', '')}"
    ms = {k: r[f"step_time_s_{k}"] * 1e3 for k in ("median", "min", "max")}
    cells = (f"{r['params'] / 1e6:.1f}M", f"{r['tokens_per_s']:,.0f}",
             *(f"{r[k]:.1%}" if k in r else "-" for k in ("mfu", "hfu")),
             f"{ms['median']:.1f}", f"[{ms['min']:.0f}-{ms['max']:.0f}]", f"{r['compile_s']:.1f}",
             f"{r['memory_bytes_per_device']['total'] / 2**20:,.1f}")
    return name + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS[1:]))


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=suites.SUITES, default="cpu",
                        help="cpu: 8 simulated CPU devices; gpu-1: one GPU, bf16, ladders of "
                             "models up to the largest that fits (default: %(default)s)")
    parser.add_argument("--cases", metavar="NAME,...", help="a subset, by name or shell pattern")
    parser.add_argument("--steps", type=int, help="timed steps per case (default: cpu 5, gpu-1 10)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: cpu 1, gpu-1 2)")
    parser.add_argument("--json-out", type=Path, default=Path("bench.json"), metavar="FILE",
                        help="results as JSON, rewritten after each case (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true",
                        help="gpu-1 only: its ladders with tiny models, runnable on CPU")
    parser.add_argument("--memory-limit", type=int, metavar="BYTES",
                        help="bytes per device a case may use (default: the device's bytes_limit; "
                             f"with --dry-run {suites.DRY_LIMIT})")
    parser.add_argument("--list", action="store_true", help="print the suite's case names and exit")
    cpu.add_devices_flag(parser, default_help="XLA_FLAGS's, else 8 for --suite cpu, 1 for gpu-1")
    args = parser.parse_args(argv)
    steps, warmup = suites.DEFAULT_STEPS[args.suite]
    return argparse.Namespace(**{**vars(args), "steps": steps if args.steps is None else args.steps,
                                 "warmup": warmup if args.warmup is None else args.warmup})


def check(args: argparse.Namespace) -> None:
    """Bad arguments, before anything compiles."""
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: time at least 1 step")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be 0 or more")
    if args.memory_limit is not None and args.memory_limit < 1:
        raise ValueError(f"--memory-limit {args.memory_limit}: give a positive byte count")
    if args.dry_run and args.suite != "gpu-1":
        raise ValueError(f"--dry-run with --suite {args.suite}: only gpu-1 has a dry run")
    if not args.json_out.parent.is_dir():
        raise ValueError(f"--json-out {args.json_out}: no directory {args.json_out.parent}")


def start_devices(args: argparse.Namespace) -> None:
    """Simulate the suite's CPU devices (before anything asks JAX for
    devices), and refuse gpu-1 off a GPU unless it is a dry run."""
    cpu.simulate(args.devices, default=8 if args.suite == "cpu" else 1)
    platform = jax.devices()[0].platform
    if args.suite == "gpu-1" and not args.dry_run and platform != "gpu":
        raise ValueError(f"--suite gpu-1 on {platform}: it needs a GPU; add --dry-run to "
                         "climb its ladders with tiny models here")


def show(json_out: Path, suite: str, results: list[dict]) -> None:
    """The newest case's row, and the JSON file rewritten with every result so far."""
    print(row(results[-1]), flush=True)
    measure.write_json(json_out, suite, results)


def banner(args: argparse.Namespace, cases: list, limit: int | None) -> str:
    return (f"suite {args.suite}{' (dry run)' if args.dry_run else ''} on {measure.device_line()}: "
            f"{len(cases)} case(s), {args.warmup} warm-up + {args.steps} timed steps each"
            + (f", memory limit {limit / 2**30:.3g} GiB per device" if limit else ""))


def print_totals(results: list[dict], seconds: float, json_out: Path) -> None:
    ok = sum(r["status"] == "ok" for r in results)
    print(f"{ok} of {len(results)} case(s) ran in {seconds:.0f} s; wrote {json_out}")
    for dtype, p in measure.peaks(results).items():
        if p is not None:
            print(f"peak {dtype}: {p['tflops_per_device'] * 1e3:,.1f} GFLOP/s per device ({p['source']})")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        check(args)
        cases = suites.select(suites.suite(args.suite, args.dry_run), args.cases)
        if args.list:
            print("\n".join(c.name for c in cases))
            return 0
        start_devices(args)
    except ValueError as e:  # DevicesError is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    limit = args.memory_limit or (suites.DRY_LIMIT if args.dry_run else measure.device_limit())
    started = time.perf_counter()
    print(banner(args, cases, limit), flush=True)
    print(header(), flush=True)
    results = measure.run_suite(cases, limit, args.warmup, args.steps,
                                functools.partial(show, args.json_out, args.suite))
    print_totals(results, time.perf_counter() - started, args.json_out)
    return 0
