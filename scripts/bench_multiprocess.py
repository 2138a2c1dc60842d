"""Step time of N processes x K devices against 1 process x N*K devices.

    python scripts/bench_multiprocess.py -n 2 --devices-per-process 4 --steps 20

Runs `scripts/train.py` twice on the same mesh and data: in one process with
every device, then under `scripts/launch.py` with the devices split over
processes (collectives between processes go through gloo over TCP instead of
shared memory). Reports the median step time of each, after the first
steps, and their ratio. The two runs follow each other, so load on a shared
machine can differ between them; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def median_step(metrics: Path, skip: int) -> float:
    times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()]
    return statistics.median(times[skip:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, default=2,
                        help="processes of the multi-process run (default: %(default)s)")
    parser.add_argument("--devices-per-process", type=int, default=4,
                        help="simulated CPU devices per process; the one-process run has -n "
                             "times as many (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20,
                        help="train steps per run (default: %(default)s)")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out (warm-up)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- more scripts/train.py flags (default: the main job's)")
    args = parser.parse_args(argv)
    extra = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    devices = args.num_processes * args.devices_per_process
    common = ["--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "1",
              "--no-progress", "--mesh", f"fsdp={devices}", *extra]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, prefix in (
                ("1 process", [sys.executable, "scripts/train.py", "--devices", str(devices)]),
                (f"{args.num_processes} processes",
                 [sys.executable, "scripts/launch.py", "-n", str(args.num_processes),
                  "--devices-per-process", str(args.devices_per_process), "--", "scripts/train.py"])):
            metrics = Path(tmp) / f"{len(results)}.jsonl"
            p = subprocess.run([*prefix, *common, "--metrics-out", str(metrics)], cwd=ROOT,
                               capture_output=True, text=True)
            if p.returncode != 0:
                print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
                return p.returncode
            results[name] = median_step(metrics, args.skip)
    base = results["1 process"]
    print(f"{devices} devices, mesh fsdp={devices}, {args.steps} steps (first {args.skip} left out)")
    print(f"{'run':<16}{'median step (s)':>16}{'ratio':>8}")
    for name, t in results.items():
        print(f"{name:<16}{t:>16.3f}{t / base:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
