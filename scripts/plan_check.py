"""The planner's memory figures against compiled programs and real arrays.

    python scripts/plan_check.py                 # gpt-small, 12 layouts, seq 128 and 1024
    python scripts/plan_check.py --seq-len 128 --layouts 3

On 8 simulated CPU devices (unless --devices or XLA_FLAGS say otherwise;
the layouts need 8), for each layout: the planner's analytic estimate
(model states plus what a step adds, the figure it prunes with) against the
compiled step's arguments plus temporaries, and its model-state bytes
against the bytes one device holds of a real, initialised state (read from
each array's addressable shards). float32, so that XLA:CPU's widening of
bf16 temporaries does not enter the comparison.
"""

from __future__ import annotations

import argparse

import jax

import models
from zero_jax.runtime import cpu
from zero_jax.runtime import device_kinds
from zero_jax.analysis import memory
from zero_jax.planner import choices, cost
from zero_jax import job as job_lib, config as config_lib

# (pipe, tensor, data, zero, remat, micro, microbatches, schedule, v) on 8 devices, global batch 16.
LAYOUTS = [
    choices.Choice(1, 1, 8, 0, "full", 2, 1),
    choices.Choice(1, 1, 8, 1, "full", 2, 1),
    choices.Choice(1, 1, 8, 2, "full", 1, 2),
    choices.Choice(1, 1, 8, 3, "full", 1, 2),
    choices.Choice(1, 1, 8, 3, "none", 2, 1),
    choices.Choice(1, 1, 8, 2, "dots_saveable", 2, 1),
    choices.Choice(1, 2, 4, 1, "full", 2, 2),
    choices.Choice(1, 2, 4, 3, "none", 4, 1),
    choices.Choice(2, 1, 4, 1, "full", 1, 4, "1f1b"),
    choices.Choice(2, 1, 4, 3, "none", 2, 2, "1f1b"),
    choices.Choice(4, 1, 2, 1, "full", 2, 4, "interleaved", 2),
    choices.Choice(2, 2, 2, 2, "full", 2, 4, "1f1b"),
]


def held_bytes(tree) -> int:
    """Bytes of `tree` on the first device, from the arrays' addressable shards."""
    first = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
               if s.device == first)


def check(choice: choices.Choice, seq_len: int, cluster: choices.Cluster) -> dict:
    base = {"model.name": "gpt-small", "model.vocab_size": 50257, "precision.policy": "fp32",
            "data.seq_len": seq_len, "train.batch_size": 16}
    flat = choice.flat(base)
    build = models.for_run(config_lib.build(None, flat).model, 50257)[0]
    est = cost.estimate(choices.abstract_job(flat, build, 8), choice, cluster, platform="cpu")
    job = job_lib.prepare(config_lib.build(None, flat), build)
    m = memory.compiled(job.compile_train_step())
    compiled = m["argument_bytes"] + m["temp_bytes"]
    state = job.init_state()
    real = held_bytes(state.params) + held_bytes(state.opt_state)
    del state
    return {"layout": choice.label, "seq_len": seq_len, "analytic": est.memory.device_bytes,
            "compiled": compiled, "error": est.memory.device_bytes / compiled - 1,
            "state": est.memory.state["params"] + est.memory.state["opt_state"], "real_state": real}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, action="append",
                        help="sequence length; repeat for several (default: 128 and 1024)")
    parser.add_argument("--layouts", type=int, default=len(LAYOUTS),
                        help="check the first N layouts of the list (default: all %(default)s)")
    cpu.add_devices_flag(parser, default_help="XLA_FLAGS's, else 8")
    args = cpu.parse_args(parser, argv, default=8)
    cluster = choices.Cluster(device_kinds.load("a100-80gb"), 1, 8)
    rows = []
    print(f"{'layout':<58}{'seq':>6}{'analytic MB':>13}{'compiled MB':>13}{'error':>8}"
          f"{'state exact':>13}")
    for seq in args.seq_len or (128, 1024):
        for choice in LAYOUTS[:args.layouts]:
            r = check(choice, seq, cluster)
            rows.append(r)
            print(f"{r['layout']:<58}{seq:>6}{r['analytic'] / 1e6:>13.1f}{r['compiled'] / 1e6:>13.1f}"
                  f"{r['error']:>+8.1%}{str(r['state'] == r['real_state']):>13}", flush=True)
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"worst analytic error {worst['error']:+.1%} ({worst['layout']}, seq {worst['seq_len']}); "
          f"model states exact in {sum(r['state'] == r['real_state'] for r in rows)} of {len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
