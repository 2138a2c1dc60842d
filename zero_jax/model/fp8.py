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

Delayed scaling takes it from the largest magnitude seen over the last H
steps instead (Transformer Engine's "max" algorithm), so no step waits on a
reduction over the whole tensor before rounding it. Each product keeps an
amax history: a float32 parameter of shape (3, H), rows x, w and the output
gradient, newest first, named `<weight>_fp8_history`. Being a parameter it is
sharded, stacked over layers, checkpointed and restored onto any mesh like
the rest. The product reports this step's three amaxes as the history's
"gradient" (column 0, zeros elsewhere); where gradients are summed
(microbatches, batch shards, pipeline ticks) histories' are combined by max
(`combine`), and the step shifts them in (`advance`) in place of an
optimizer update. An empty history (the first step) scales currently.
"""

from __future__ import annotations

from typing import Any

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



@jax.custom_vjp
def entering(x: jax.Array) -> jax.Array:
    """x rounded to e4m3 at its current scale; its gradient passes through."""
    return rounded(x, E4M3)


entering.defvjp(lambda x: (rounded(x, E4M3), None), lambda _, g: (g,))


@jax.custom_vjp
def leaving(y: jax.Array) -> jax.Array:
    """y itself; its gradient rounded to e5m2 at its current scale."""
    return y


leaving.defvjp(lambda y: (y, None), lambda _, g: (rounded(g, E5M2),))


def product(fn):
    """`fn(x, w)`, a matrix product, in FP8 through autodiff: both operands
    rounded to e4m3 as they enter and the output's gradient to e5m2 as it
    leaves, so both backward products take the rounded operands (a product
    with no custom VJP of its own: a mixture's grouped expert GEMMs). The
    residuals are the rounded operands in their own dtype."""
    return lambda x, w: leaving(fn(entering(x), entering(w)))


# --- delayed scaling: the amax history --------------------------------------

SCALINGS = ("current", "delayed")
HISTORY = "_fp8_history"  # the suffix of an amax history parameter's name
ROWS = 3  # x, w, the output gradient


def history_name(weight: str) -> str:
    return weight + HISTORY


def is_history(path) -> bool:
    """Whether a tree path (jax.tree_util key path) names an amax history."""
    last = path[-1] if path else None
    key = getattr(last, "key", getattr(last, "name", None))
    return isinstance(key, str) and key.endswith(HISTORY)


def delayed(x: jax.Array, dtype, history: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x in `dtype` at the scale of the largest magnitude in `history` (one
    row), clipped where x has outgrown it; at x's own scale where the
    history is still empty."""
    seen = jnp.max(history)
    scale = jnp.where(seen > 0, scale_for(seen, dtype), scale_for(jnp.max(jnp.abs(x)), dtype))
    return quantize(x, dtype, scale), scale


def amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def report(history: jax.Array, amaxes: tuple[jax.Array, ...]) -> jax.Array:
    """The history's "gradient": this use's amaxes (x, w, output gradient)
    in column 0, zeros elsewhere."""
    return jnp.zeros_like(history).at[:, 0].set(jnp.stack(amaxes))


def combine(a: Any, b: Any) -> Any:
    """Two gradient trees' sum, histories' reports combined by max."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x, y: jnp.maximum(x, y) if is_history(path) else x + y, a, b)


def without_histories(grads: Any) -> Any:
    """The gradients an optimizer sees: zeros for the histories."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if is_history(path) else g, grads)


def advance(new_params: Any, old_params: Any, grads: Any) -> Any:
    """`new_params` with each history shifted one step (oldest dropped) and
    this step's amaxes (its reported column 0) put first."""
    def one(path, new, old, g):
        if not is_history(path):
            return new
        shifted = jnp.roll(old, 1, axis=-1)
        return shifted.at[..., 0].set(g[..., 0].astype(old.dtype))
    return jax.tree_util.tree_map_with_path(one, new_params, old_params, grads)


def has_histories(tree: Any) -> bool:
    return any(is_history(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree))
