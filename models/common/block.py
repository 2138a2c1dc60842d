"""The pre-norm transformer block both families compute: norm -> attention
-> residual -> norm -> MLP -> residual, each activation laid out and named
for the rules and the remat policies (`pre_norm`), and the same block as
contract.Op's for remat and the planner (`ops`).

A family passes its own pieces: its norms (modules), its attention and its
MLP (functions). The pieces declare their parameters on the family's block
module, so its parameter tree and names are the family's own.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import layers
from zero_jax.model.contract import Op
from zero_jax.model.hooks import Hooks

RESIDUAL = ("batch", "res_seq", "embed")  # split along the sequence under sequence parallelism
GATHERED = ("batch", "seq", "embed")  # whole along the sequence, for the matrix products


def add_bias(hooks: Hooks, param: Callable, x: jax.Array, name: str, shape: tuple,
             names: tuple) -> jax.Array:
    """x plus the bias parameter `name` (declared through `param`, the
    block's), added in float32 so that its gradient is reduced in float32."""
    b = hooks.weight(param(name, shape, names, nn.initializers.zeros), names, jnp.float32)
    return (x.astype(jnp.float32) + b).astype(x.dtype)


def attend(hooks: Hooks, q: jax.Array, k: jax.Array, v: jax.Array, segments_BxT,
           window: int = 0) -> jax.Array:
    """Causal attention of both families (layers.attention: scores and
    softmax in float32), its probabilities (`attn_probs`) and its context
    (`attn_ctx`) named for the remat policies."""
    def probs(p):
        return hooks.act(p, ("batch", "heads", "seq", None), name="attn_probs")
    return hooks.act(hooks.attend(layers.attention, q, k, v, window=window, keep=probs,
                                  segments_BxT=segments_BxT),
                     ("batch", "seq", "heads", "kv"), name="attn_ctx")


def pre_norm(hooks: Hooks, x_BxTxD: jax.Array, norm_1: Callable, attention: Callable,
             norm_2: Callable, mlp: Callable[[jax.Array], tuple[jax.Array, Any]]
             ) -> tuple[jax.Array, Any]:
    """x + attention(norm_1(x)), then that + mlp(norm_2(that)): the block's
    output and the MLP's statistics (a mixture of experts' router
    statistics, or None).

    Each norm's output is kept (`ln_out`) in the residual layout, and
    gathered along the sequence for the products; `attention(y)` returns
    its output projection and `mlp(y)` its output projection and
    statistics, each (B, T, D), laid out here as the residual stream
    before they are added to it.
    """
    h = hooks
    x_BxTxD = h.act(x_BxTxD, RESIDUAL)
    y = h.act(h.act(norm_1(x_BxTxD), RESIDUAL, name="ln_out"), GATHERED)
    x_BxTxD = h.act(x_BxTxD + h.act(attention(y), RESIDUAL), RESIDUAL, name="resid_mid")
    y = h.act(h.act(norm_2(x_BxTxD), RESIDUAL, name="ln_out"), GATHERED)
    out_BxTxD, stats = mlp(y)
    return x_BxTxD + h.act(out_BxTxD, RESIDUAL), stats


def ops(seq_len: int, d_model: int, heads: int, head_dim: int, qkv_features: int,
        mlp: list[Op], value_dim: int = 0) -> list[Op]:
    """One pre-norm block as contract.Op's, named as `pre_norm` and the
    families' pieces name their activations: norm, q/k/v projections
    (`qkv_features` outputs per token; for latent attention the FLOPs of
    its compressions and expansions over D), attention, output projection
    and residual, norm ("norm_2", what `mlp`'s first ops read), then `mlp`,
    whose last matmul feeds the residual only. `value_dim`: each head's
    value width where it is not `head_dim`."""
    D, H, Q, T = d_model, heads, head_dim, seq_len
    V = value_dim or Q
    return [Op("norm_1", "ln_out", 0, ("x",), width=D),
            Op("qkv", "qkv", 2 * D * qkv_features, ("norm_1",), dot=True, width=qkv_features,
               split="out"),
            Op("scores", None, 2 * T * H * Q, ("qkv",), dot=True, width=H * T, split="out"),
            Op("probs", "attn_probs", 0, ("scores",), needs=("self",), width=H * T, split="out"),
            Op("ctx", "attn_ctx", 2 * T * H * V, ("probs", "qkv"), dot=True, width=H * V,
               split="out"),
            Op("out", None, 2 * H * V * D, ("ctx",), dot=True, width=D, split="in"),
            Op("mid", "resid_mid", 0, ("x", "out"), needs=(), width=D),
            Op("norm_2", "ln_out", 0, ("mid",), width=D),
            *mlp]
