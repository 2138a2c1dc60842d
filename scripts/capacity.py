"""The largest GPT-family model one device trains, with and without host offload.

    python scripts/capacity.py                       # A100-80GB and H200, 1 TB of host memory
    python scripts/capacity.py --devices h100-80gb --host-bytes 2e12 --json

GPT-3's shape at its 6.7B-175B aspect ratio (d_model = 128 x n_layer),
sequence 2048, micro-batch 1, full remat, bf16 with float32 master weights
and Adam, for each device kind and offload mode (none, opt, opt+params),
each at its best ZeRO stage; from shapes only, nothing allocated or
compiled (zero_jax/planner/capacity.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zero_jax.planner import capacity  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="a100-80gb,h200-141gb", help="device kinds (meshes/devices/)")
    p.add_argument("--host-bytes", type=float, default=1e12, help="host memory for the one device")
    p.add_argument("--grad-dtype", default="float32",
                   help="gradient dtype (the bf16 policy's: float32; bfloat16 halves it)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    try:
        devices = capacity.devices(args.devices.split(","), args.host_bytes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = capacity.rows(devices, args.grad_dtype)
    print(json.dumps(rows, indent=1) if args.json else
          "\n".join(capacity.table(rows, args.grad_dtype, args.host_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
