"""A block's projection in FP8, as one custom VJP (what `Hooks.dense` runs
under `--precision fp8`).

Forward: x and w rounded to e4m3, each at its scale, widened and
multiplied. Backward: the output gradient rounded to e5m2, and both
products (input gradient, weight gradient) take it and the forward's e4m3
operands. x is kept for the backward pass in 8 bits; w as stored, gathered
again and rounded alike, as `param_use.dense` does.

At ZeRO-3 the weight is rounded where it is stored and gathered in 8 bits
(`Use.gather_fp8`): the all-gather moves a byte per element, and a scale.

Scales are current (each tensor's own largest magnitude) where `history`
is None, delayed otherwise: from the rows of the amax history (3, H), and
the "gradient" of the history is this use's amaxes (fp8.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zero_jax.model import fp8
from zero_jax.model.param_use import Use, dense_weight_grad, operands


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def dense(use: Use, eq: str, x, w, history):
    """einsum(eq, x, w) in FP8; `history`: None (current scaling), or the
    (3, H) float32 amax history, gathered (delayed scaling)."""
    return _fwd(use, eq, x, w, history)[0]


def _rounded(a, dtype, history, row: int):
    if history is None:
        return fp8.current(a, dtype)
    return fp8.delayed(a, dtype, history[row])


def _weight(use: Use, w, history):
    """The weight as the product uses it: e4m3 and its scale, gathered."""
    if use.gathered:  # already gathered in the compute dtype: rounded here
        return _rounded(w, fp8.E4M3, history, 1)
    return use.gather_fp8(w, None if history is None else history[1])


def _fwd(use, eq, x, w, history):
    xq, sx = _rounded(x, fp8.E4M3, history, 0)
    wq, sw = _weight(use, w, history)
    y = jnp.einsum(eq, fp8.dequantize(xq, sx, x.dtype), fp8.dequantize(wq, sw, x.dtype))
    amaxes = None if history is None else (fp8.amax(x), fp8.amax(w))
    return y, (xq, sx, w, history, amaxes)


def _bwd(use, eq, res, g):
    xq, sx, w, history, amaxes = res
    gq, sg = _rounded(g, fp8.E5M2, history, 2)
    g8 = fp8.dequantize(gq, sg, g.dtype)
    wq, sw = _weight(use, w, history)
    xs, ws, ys = operands(eq)
    dx = jnp.einsum(f"{ys},{ws}->{xs}", g8, fp8.dequantize(wq, sw, g.dtype))
    dw = dense_weight_grad(use, eq, fp8.dequantize(xq, sx, g.dtype), g8)
    report = None if history is None else fp8.report(history, (*amaxes, fp8.amax(g)))
    return dx, dw, report


dense.defvjp(_fwd, _bwd)
