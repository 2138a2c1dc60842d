"""FP8 against bf16 on one device: the compiled step's matrix products by
kind, and each step's tokens/s, in one run.

    python scripts/fp8_check.py                       # gpt-small and gpt-xl on a GPU
    python scripts/fp8_check.py --models gpt-small --steps 5 --json
    python scripts/fp8_check.py --dry-run             # a tiny GPT on the CPU: the script itself

Each model runs as `zero-jax bench --suite gpu-1` runs it (ZeRO-3 on one
device, sequence 1024, 16 rows in 2 microbatches, its rung's remat), once
with `--precision bf16` and once with `--precision fp8`: compiled ahead of
time, its GEMMs counted in the compiled HLO (zero_jax/analysis/hlo.py
`gemms`: cuBLASLt's FP8 GEMMs are what XLA:GPU makes of the FP8
products; a CPU keeps them as dots), then timed on one synthetic batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zero_jax.analysis import hlo  # noqa: E402
from zero_jax.bench import measure, suites  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt-small,gpt-xl",
                        help="rungs of the gpu-1 gpt ladder (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the dry ladder's smallest GPT on the CPU instead")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser.parse_args(argv)


def cases(args) -> list[suites.Case]:
    if args.dry_run:
        ladder, base, names = suites.DRY_LADDERS["dry"], suites.DRY_BASE, ["dry-d64"]
    else:
        ladder, base, names = suites.GPU_LADDERS["gpt"], suites.GPU_BASE, args.models.split(",")
    return [suites.Case(f"{name}/{precision}", {**base, **ladder[name][0],
                                                "activations.remat": ladder[name][1],
                                                "precision.policy": precision})
            for name in names for precision in ("bf16", "fp8")]


def measured(case: suites.Case, warmup: int, steps: int) -> dict:
    job = measure.prepare(case)
    compiled = job.lower_train_step().compile()
    times = measure.timed_steps(compiled, job.init_state(), measure.synthetic_batch(job), warmup,
                                steps)
    step_s = statistics.median(times)
    tokens = job.run.train.batch_size * job.run.data.seq_len
    return {"case": case.name, "gemms": hlo.gemms(compiled.as_text()), "step_s": step_s,
            "tokens_per_s": tokens / step_s}


def main(argv=None) -> int:
    args = parse(argv)
    print(measure.device_line(), flush=True)
    results = [measured(case, args.warmup, args.steps) for case in cases(args)]
    by_case = {r["case"]: r for r in results}
    for r in results:
        model, precision = r["case"].split("/")
        if precision == "fp8":
            r["fp8_over_bf16"] = r["tokens_per_s"] / by_case[f"{model}/bf16"]["tokens_per_s"]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    kinds = list(results[0]["gemms"])
    print(f"{'case':<18}{'tokens/s':>11}{'step s':>9}{'x bf16':>8}  " + "  ".join(kinds))
    for r in results:
        ratio = f"{r['fp8_over_bf16']:.2f}" if "fp8_over_bf16" in r else "-"
        print(f"{r['case']:<18}{r['tokens_per_s']:>11,.0f}{r['step_s']:>9.3f}{ratio:>8}  "
              + "  ".join(f"{r['gemms'][k]:>{len(k)}}" for k in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
