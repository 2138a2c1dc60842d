"""Peak host memory of importing a Hugging Face directory, beside the largest
tensor in it.

    python scripts/import_memory.py DIR [--mesh fsdp=-1] [--zero-stage 3] [--param-dtype bfloat16]

Builds the job for the directory's own shape (`--model hf:DIR`), then
imports its weights (models/common/hf_files.py: one tensor at a time into the
sharded layout) and prints (as JSON under `--json`, in bytes) the peak resident memory the import added, the
bytes of the parameters it placed, the difference, and the largest tensor.
On a CPU the devices' memory is the process's, so the placed parameters are
part of the peak; what the import itself holds is the difference. The
host's own share is measured apart as well: the peak bytes of numpy arrays
alive at once (tracemalloc sees numpy's allocations, not the devices'
buffers), which is what a GPU host holds. A tensor stays in the file's dtype
on the host and is cast on the devices, to float32 by default or to
`--param-dtype`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from pathlib import Path

import jax
import numpy as np

import models
from models.common import hf_files
from zero_jax import config as config_lib, job as job_lib
from zero_jax.runtime import cpu, procmem


def largest_tensor_bytes(path: Path, itemsize: int = 4) -> int:
    """In the dtype the import places parameters in (float32 by default)."""
    tensors = hf_files.Tensors(path)
    return max(int(np.prod(tensors.shape(name))) * itemsize for name in tensors.files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a Hugging Face model directory (config.json and safetensors)")
    parser.add_argument("--mesh", default="fsdp=-1", help="default: every device on fsdp")
    parser.add_argument("--zero-stage", type=int, default=3,
                        help="ZeRO stage of the layout imported into (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, in bytes")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the dtype the parameters are placed in")
    cpu.add_devices_flag(parser)
    args = cpu.parse_args(parser, argv)
    run = config_lib.build(None, {"model.name": f"hf:{args.dir}", "parallel.mesh": args.mesh,
                                  "parallel.zero_stage": args.zero_stage, "data.seq_len": 8,
                                  "train.batch_size": jax.device_count(),
                                  "precision.param_dtype": args.param_dtype})
    job = job_lib.prepare(run, models.for_run(run.model, 0)[0])
    tracemalloc.start()
    baseline = procmem.reset_peak()
    params = jax.block_until_ready(models.hf_loader(args.dir, job))
    peak = procmem.resident("VmHWM") - baseline
    host_arrays = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    placed = sum(x.nbytes for x in jax.tree.leaves(params))
    largest = largest_tensor_bytes(Path(args.dir), np.dtype(args.param_dtype).itemsize)
    if args.json:
        print(json.dumps({"peak_added_bytes": peak, "param_bytes": placed,
                          "peak_beyond_params_bytes": peak - placed,
                          "host_arrays_peak_bytes": host_arrays,
                          "largest_tensor_bytes": largest}))
    else:
        mib = 2**20
        print(f"importing {args.dir} added {peak / mib:,.1f} MiB of peak resident memory: "
              f"{placed / mib:,.1f} MiB of placed parameters and {(peak - placed) / mib:,.1f} MiB "
              f"beyond them ({(peak - placed) / largest:.2f}x the largest tensor, "
              f"{largest / mib:,.1f} MiB as {args.param_dtype}); numpy arrays on the host peaked "
              f"at {host_arrays / mib:,.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
