"""What the compiled step does with host memory: activation offload
(`remat = "offload"`) against `save_names`, and optimizer offload.

    python scripts/check_offload.py --devices 8
    python scripts/check_offload.py --mesh fsdp=1 --model gpt-small     # on one GPU

For each variant it compiles the train step and reads, from the compiled
program (not the lowered one): buffers in the host memory space (`S(5)`),
host-compute instructions, and the device and host bytes that
`memory_analysis()` reports. On XLA:CPU the activation offload annotations
of the lowered program are dropped when it compiles (no `S(5)` buffer, the
same temporaries as `save_names`), so the activation check is one for a
GPU or TPU; the optimizer's host update compiles on CPU too. A check, not
a test.
"""

from __future__ import annotations

import argparse
import json

import jax

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.runtime import cpu
import bench_flags
from zero_jax.data import corpus as corpus_lib
from zero_jax.analysis import memory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_flags.add(parser, model="gpt-tiny", mesh="fsdp=8", zero_stage=3, precision="bf16",
                    seq_len=128, batch_size=16)
    cpu.add_devices_flag(parser)
    args = cpu.parse_args(parser, argv)
    corpus = corpus_lib.load("stdlib")
    variants = {"save_names": dict(remat="save_names"), "remat offload": dict(remat="offload"),
                "optimizer offload": dict(remat="save_names", optimizer=True)}
    rows = {}
    for name, v in variants.items():
        cfg = config_lib.build(None, {
            "model.name": args.model, "parallel.mesh": args.mesh,
            "parallel.zero_stage": args.zero_stage, "precision.policy": args.precision,
            "data.seq_len": args.seq_len, "train.batch_size": args.batch_size,
            "activations.remat": v["remat"], "offload.optimizer": v.get("optimizer", False)})
        job = job_lib.prepare(cfg, models.builder(args.model, corpus.vocab_size))
        lowered = job.lower_train_step()
        compiled = lowered.compile()
        text = compiled.as_text()
        m = compiled.memory_analysis()
        rows[name] = {
            "lowered_host_placements": lowered.as_text().count("annotate_device_placement"),
            "compiled_host_buffers": text.count("S(5)"),
            "compiled_host_compute": text.count('_xla_compute_type="host"'),
            "temp_bytes": memory.compiled(compiled)["temp_bytes"],
            "host_temp_bytes": int(m.host_temp_size_in_bytes),
            "host_argument_bytes": int(m.host_argument_size_in_bytes),
        }
    print(json.dumps({"platform": jax.devices()[0].platform, "devices": jax.device_count(),
                      "model": args.model, "mesh": args.mesh, "variants": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
