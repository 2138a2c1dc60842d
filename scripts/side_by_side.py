"""zero_jax's train step beside PyTorch's, same shape, interleaved rounds.

    .venv/bin/python scripts/side_by_side.py [--rounds 3] [--steps 20] [--torch-python P]

Each round runs, one after another, each in its own fresh process: PyTorch in
one process, zero_jax on 1 device, PyTorch FSDP2 over 2 gloo ranks, zero_jax
on `fsdp=2` at ZeRO-3 (2 simulated devices in one process). The shape is
gpt-tiny's, float32, batch 32 x 128, AdamW (scripts/bench_torch.py), the
step timed after a warm-up and waited on each time. Prints every round, then
for each pair the median tokens/s over the rounds, its range, and the ratio
zero_jax / torch of each round. Interleaving keeps a change in the machine's
load from favouring one side.

`--worker` runs one zero_jax measurement and prints JSON (what a round calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (label, torch ranks, zero_jax devices, zero_jax flags), in the order a round runs them.
PAIRS = [
    ("1 process / 1 device", 1, 1, ["--mesh", "data=1", "--zero-stage", "0"]),
    ("FSDP2 2 ranks / fsdp=2 ZeRO-3", 2, 2, ["--mesh", "fsdp=2", "--zero-stage", "3"]),
]


def worker(args, flag_args: list[str]) -> int:
    """Time zero_jax's compiled train step of `flag_args`; print tokens/s as JSON."""
    sys.path.insert(0, str(ROOT))
    from zero_jax.runtime import cpu

    cpu.simulate(args.devices)
    import jax

    import models
    from zero_jax.config import flags
    from zero_jax import job as job_lib
    from zero_jax.data import corpus as corpus_lib

    parser = argparse.ArgumentParser()
    flags.add_flags(parser)
    cfg = flags.from_args(parser.parse_args(
        ["--model", "gpt-tiny", "--batch-size", str(args.batch_size), "--seq-len",
         str(args.seq_len), "--eval-every", "0", *flag_args]), None)
    corpus = corpus_lib.load(cfg.data.source)
    build, _ = models.for_run(cfg.model, corpus.vocab_size)
    job = job_lib.prepare(cfg, build)
    step = job.compile_train_step()
    state = job.init_state()
    batches = [corpus_lib.global_batch(corpus, "train", cfg.data.seq_len, cfg.train.batch_size,
                                     cfg.train.seed, step=i, sharding=job.state_plan.batch_sharding)
               for i in range(4)]
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batches[i % len(batches)])
        jax.block_until_ready(metrics)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(json.dumps({"median_step_ms": median * 1e3,
                      "tokens_per_s": args.batch_size * args.seq_len / median}))
    return 0


def measure_torch(args, ranks: int) -> float:
    out = subprocess.run([args.torch_python, str(ROOT / "scripts/bench_torch.py"), "--ranks",
                          str(ranks), "--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)],
                         capture_output=True, text=True, check=True).stdout
    return float(out.rsplit("ms, ", 1)[1].split(" tokens/s")[0].replace(",", ""))


def measure_zero_jax(args, devices: int, flag_args: list[str]) -> float:
    out = subprocess.run([sys.executable, __file__, "--worker", "--devices", str(devices),
                          "--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                          "--", *flag_args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="global rows (default 32)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    parser.add_argument("--torch-python", default=str(ROOT / ".venv-interop/bin/python"),
                        help="a Python with torch (default .venv-interop's: make test-interop)")
    parser.add_argument("--worker", action="store_true",
                        help="internal: time one zero_jax run, print JSON")
    parser.add_argument("--devices", type=int, default=1, help="internal: the worker's devices")
    parser.add_argument("flags", nargs="*", help="internal: the worker's train.py flags")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args, args.flags)
    if not Path(args.torch_python).exists():
        print(f"error: --torch-python {args.torch_python} does not exist; build it with "
              "make test-interop, or name a Python that has torch", file=sys.stderr)
        return 2
    results = {label: ([], []) for label, *_ in PAIRS}
    for r in range(1, args.rounds + 1):
        for label, ranks, devices, flag_args in PAIRS:
            torch_tps = measure_torch(args, ranks)
            jax_tps = measure_zero_jax(args, devices, flag_args)
            results[label][0].append(torch_tps)
            results[label][1].append(jax_tps)
            print(f"round {r}, {label}: torch {torch_tps:,.0f} tokens/s, zero_jax "
                  f"{jax_tps:,.0f} ({jax_tps / torch_tps:.2f}x)", flush=True)
    print(f"\nmedians over {args.rounds} rounds (range), tokens/s, {args.batch_size} x "
          f"{args.seq_len} tokens per step, {args.steps} timed steps per run:")
    for label, (torch_tps, jax_tps) in results.items():
        ratios = [j / t for t, j in zip(torch_tps, jax_tps)]
        print(f"  {label}: torch {statistics.median(torch_tps):,.0f} ({min(torch_tps):,.0f}-"
              f"{max(torch_tps):,.0f}), zero_jax {statistics.median(jax_tps):,.0f} "
              f"({min(jax_tps):,.0f}-{max(jax_tps):,.0f}), ratio per round "
              f"{', '.join(f'{x:.2f}' for x in ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
