"""Time a few GEMMs per dtype on this device and write them as the planner's
`gemm_sweep`: a measured curve that replaces a device kind's estimated one.

    python scripts/gemm_sweep.py --toml OUT/gemm.toml          # on a GPU: the layer shapes
    python scripts/gemm_sweep.py --shapes 256x256x256 --dtypes float32

Each shape M x N x K (an M x K by a K x N product, jitted) runs a few times
untimed, then `--repeats` times; its rate is 2 M N K FLOPs over the median
time. The TOML line, pasted into meshes/devices/<kind>.toml (or a copy of
it given to `zero-jax plan --cluster PATH`), makes the planner price each
product at the rate of the nearest swept shape (zero_jax/planner/kernels.py)
and lifts the kind's MFU ceiling.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

# The products of the published runs' layers (docs/planning.md#published-runs):
# square references, a 1.7B GPT's (d 2304) projections and MLP, a 7B's at
# tensor 4, attention's per-head products, a Llama 8B's MLP, a 128k head.
LAYER_SHAPES = ("4096x4096x4096", "8192x8192x8192", "16384x6912x2304", "16384x2304x9216",
                "16384x3072x4096", "16384x4096x1024", "2048x2048x128", "2048x128x2048",
                "8192x14336x4096", "8192x4096x14336", "8192x128256x4096")


def shape_of(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: --shapes {text!r}: give M x N x K as 4096x4096x4096") from None
    return m, n, k


def rate(m: int, n: int, k: int, dtype, repeats: int) -> float:
    """FLOP/s of an m x k by k x n product in `dtype`, the median of `repeats`."""
    a = jnp.ones((m, k), dtype)
    b = jnp.ones((k, n), dtype)
    dot = jax.jit(jnp.dot)
    for _ in range(3):
        dot(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * m * n * k / statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(LAYER_SHAPES),
                        help="comma list of M x N x K (default: the published runs' layer shapes)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma list of dtypes")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed runs per shape, after 3 untimed (default: %(default)s)")
    parser.add_argument("--toml", help="also write the gemm_sweep line to this file")
    args = parser.parse_args(argv)
    shapes = [shape_of(s) for s in args.shapes.split(",")]
    device = jax.devices()[0]
    print(f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    points = []
    for name in args.dtypes.split(","):
        dtype = jnp.dtype(name)
        for m, n, k in shapes:
            r = rate(m, n, k, dtype, args.repeats)
            points.append((m, n, k, dtype.itemsize, r))
            print(f"{name:>9} {m:>6} x {n:>6} x {k:>6}  {r / 1e12:9.2f} TFLOP/s", flush=True)
    line = ("gemm_sweep = [" + ", ".join(f"[{m}, {n}, {k}, {b}, {r:.4g}]" for m, n, k, b, r in points)
            + f"]  # scripts/gemm_sweep.py on {device.device_kind}, jax {jax.__version__}")
    print(line)
    if args.toml:
        with open(args.toml, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
