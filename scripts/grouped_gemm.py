"""The dropless experts' grouped GEMMs timed against each other on one
device: a SwiGLU over rows sorted by expert, forward and backward, through
the tiled loop and through jax.lax.ragged_dot (zero_jax/model/grouped.py).

    python scripts/grouped_gemm.py                          # DeepSeek-V3's expert shape, bf16
    python scripts/grouped_gemm.py --rows 512 --groups 4 --d-model 64 --d-expert 32 --dtype float32

The rows split over the groups unevenly (group g takes a share growing with
g), as a router's loads do. Printed per GEMM: the median step in ms, the
routed FLOPs per second (forward and backward: 18 rows x D x F), the FLOPs
of the dots the compiled program runs over the routed ones
(zero_jax/analysis/dot_flops.py, the tiled loops at the tiles the counts
fill), and the largest difference from the other GEMM's output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from zero_jax.analysis.dot_flops import dot_flops  # noqa: E402
from zero_jax.model import grouped  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384,
                        help="token copies on the device (default: %(default)s)")
    parser.add_argument("--groups", type=int, default=8,
                        help="experts on the device (default: %(default)s, DeepSeek-V3 on EP=32)")
    parser.add_argument("--d-model", type=int, default=7168, help="model width (default: %(default)s)")
    parser.add_argument("--d-expert", type=int, default=2048,
                        help="each expert's MLP width (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", help="operands' dtype (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps (default: %(default)s)")
    return parser.parse_args(argv)


def counts(rows: int, groups: int) -> np.ndarray:
    """Uneven loads summing to `rows`: group g's share grows with g."""
    share = np.arange(1, groups + 1, dtype=np.float64)
    c = np.floor(rows * share / share.sum()).astype(np.int32)
    c[-1] += rows - c.sum()
    return c


def swiglu_step(gemm: str, counts_G, expected_rows: int):
    """The SwiGLU's loss and its gradients through `gemm`, jitted."""
    def loss(x, w_gate, w_up, w_down):
        product = grouped.product(gemm, counts_G, expected_rows)
        hidden = jax.nn.silu(product(x, w_gate)) * product(x, w_up)
        out = product(hidden, w_down)
        return jnp.sum(jnp.square(out.astype(jnp.float32))), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def main(argv=None) -> int:
    args = parse(argv)
    R, G, D, F = args.rows, args.groups, args.d_model, args.d_expert
    dtype = jnp.dtype(args.dtype)
    print(jax.devices()[0].device_kind, jax.__version__, f"rows {R}, {G} experts, D {D}, F {F}, "
          f"{dtype.name}", flush=True)
    c = jnp.asarray(counts(R, G))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    args_ = [jax.random.normal(keys[0], (R, D), dtype)] + [
        (jax.random.normal(k, s, jnp.float32) / np.sqrt(s[1])).astype(dtype)
        for k, s in zip(keys[1:], ((G, D, F), (G, D, F), (G, F, D)))]
    routed = 18 * R * D * F
    tile = grouped.tile_rows(R, G)
    outputs = {}
    print(f"{'gemm':<12}{'ms':>10}{'TFLOP/s':>10}{'FLOPs run / routed':>20}")
    for gemm in grouped.GEMMS:
        step = swiglu_step(gemm, c, R)
        compiled = step.lower(*args_).compile()
        trips = int(grouped.plan(c, tile, R).count)
        ran = dot_flops(compiled.as_text(), trips)
        (_, out), _ = jax.block_until_ready(compiled(*args_))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args_))
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        outputs[gemm] = np.asarray(out.astype(jnp.float32))
        print(f"{gemm:<12}{ms:>10.2f}{routed / ms / 1e9:>10.3g}{ran / routed:>20.3f}")
    gap = np.max(np.abs(outputs["tiled"] - outputs["ragged_dot"]))
    print(f"tile {tile} rows; largest output difference {gap:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
