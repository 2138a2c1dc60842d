"""Peak host memory of importing a Hugging Face directory, beside the largest
tensor in it.

    python scripts/import_memory.py DIR [--mesh fsdp=-1] [--zero-stage 3]

Builds the job for the directory's own shape (`--model hf:DIR`), then
imports its weights (models/hf.py: one tensor at a time into the sharded
layout) and prints, as JSON, the peak resident memory the import added, the
bytes of the parameters it placed, the difference, and the largest tensor.
On a CPU the devices' memory is the process's, so the placed parameters are
part of the peak; what the import itself holds is the difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

import models
from models import hf
from zero_jax import config as config_lib, job as job_lib
from zero_jax.runtime import cpu, procmem


def largest_tensor_bytes(path: Path) -> int:
    """In float32, the dtype the import places parameters in."""
    tensors = hf.Tensors(path)
    return max(int(np.prod(tensors.shape(name))) * 4 for name in tensors.files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--mesh", default="fsdp=-1", help="default: every device on fsdp")
    parser.add_argument("--zero-stage", type=int, default=3)
    cpu.add_devices_flag(parser)
    args = cpu.parse_args(parser, argv)
    run = config_lib.build(None, {"model.name": f"hf:{args.dir}", "parallel.mesh": args.mesh,
                                  "parallel.zero_stage": args.zero_stage, "data.seq_len": 8,
                                  "train.batch_size": jax.device_count()})
    job = job_lib.prepare(run, models.for_run(run.model, 0)[0])
    baseline = procmem.reset_peak()
    params = jax.block_until_ready(models.hf_loader(args.dir, job))
    peak = procmem.resident("VmHWM") - baseline
    placed = sum(x.nbytes for x in jax.tree.leaves(params))
    print(json.dumps({"peak_added_bytes": peak, "param_bytes": placed,
                      "peak_beyond_params_bytes": peak - placed,
                      "largest_tensor_bytes": largest_tensor_bytes(Path(args.dir))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
