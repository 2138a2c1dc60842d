"""Numerics of the GPT block's elementwise pieces.

What the backward pass keeps is decided by the remat policy over the named
activations (zero_jax.remat); LayerNorm and GELU internals are unnamed and so
recomputed. Softmax has its own backward rule that needs only its output, in
the compute dtype, so the scores before it are never kept either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def layer_norm(x, scale, bias, eps: float):
    """LayerNorm computed in float32, returned in x's dtype."""
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    y = (h - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def gelu(x):
    """GELU, tanh approximation (as GPT-2)."""
    return jax.nn.gelu(x, approximate=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def softmax(x, dtype):
    """Softmax over the last axis computed in float32, returned in `dtype`."""
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(dtype)


def _softmax_fwd(x, dtype):
    p = softmax(x, dtype)
    return p, (p, jnp.zeros((0,), x.dtype))


def _softmax_bwd(dtype, res, g):
    p, like = res
    p32, g32 = p.astype(jnp.float32), g.astype(jnp.float32)
    return ((p32 * (g32 - jnp.sum(g32 * p32, axis=-1, keepdims=True))).astype(like.dtype),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)
