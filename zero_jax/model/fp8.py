"""FP8 numbers for matrix products: per-tensor scaled e4m3 and e5m2.

A tensor is divided by its scale, clipped to the format's largest value and
rounded to 8 bits; used, it is widened back and multiplied by the scale. A
product of two such tensors in the compute dtype is the pattern XLA:GPU
rewrites into one cuBLASLt FP8 GEMM on Hopper (the dequantising multiplies
folded into the GEMM's scale operands); on any other backend it computes
the same rounding in higher precision, so the numerics checked on a CPU
are the GPU's up to the GEMM's own accumulation order.

Forward operands (activations and weights) are e4m3, largest value 448, 3
mantissa bits; gradients are e5m2, largest 57344, 2 mantissa bits (the
Transformer Engine / Micikevicius et al. 2022 recipe). Current scaling takes
each tensor's scale from its own largest magnitude in this step: the
largest value lands on the format's largest, nothing overflows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.dtype(jnp.float8_e4m3fn)  # forward: activations, weights
E5M2 = jnp.dtype(jnp.float8_e5m2)  # backward: output gradients


def largest(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def scale_for(amax: jax.Array, dtype) -> jax.Array:
    """The float32 scale mapping magnitudes up to `amax` onto `dtype`'s range;
    1 where amax is zero or not finite (nothing to scale, or nothing safe)."""
    amax = amax.astype(jnp.float32)
    ok = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(ok, amax / largest(dtype), 1.0)


def quantize(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """x / scale in `dtype`, clipped to its range (float32 on the way)."""
    top = largest(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """q widened to `dtype` and multiplied by its scale."""
    return q.astype(dtype) * scale.astype(dtype)


def current(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x in `dtype` at its own scale (current scaling), and that scale. On a
    sharded x the largest magnitude is the whole array's (one small
    all-reduce), so every device rounds alike."""
    scale = scale_for(jnp.max(jnp.abs(x)), dtype)
    return quantize(x, dtype, scale), scale


def rounded(x: jax.Array, dtype) -> jax.Array:
    """x as the product sees it: rounded to `dtype` at its current scale and
    widened back to x's dtype."""
    q, scale = current(x, dtype)
    return dequantize(q, scale, x.dtype)

