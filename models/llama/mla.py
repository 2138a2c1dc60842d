"""Multi-head latent attention (DeepSeek-V2 and V3), declared on the block
that calls it.

Keys and values come from one low-rank compression of the block's input:
x -> c (kv_lora_rank wide, RMS-normed) -> per head, the unrotated key part
and the value. Queries come from their own normed compression (q_lora_rank;
0: one full projection). Position enters through qk_rope_head_dim further
dimensions per head, rotated: the queries' per head, and one rotated key
computed beside c and shared by every head (decoupled rotary embedding).
What is worth keeping for the backward pass is the compression: c and the
shared key (`kv_latent`) are (kv_lora_rank + qk_rope_head_dim) wide per
token where the expanded keys and values are H (Q + Q_v).

The rotated dimensions use the half-rotation layout of every other family
here; DeepSeek's files interleave them (pairs (0, 1), (2, 3), ...), which
models/llama/deepseek_hf.py permutes on the way in and out. Under YaRN the
softmax scale gains mscale(factor, mscale_all_dim)^2, as DeepSeek's
reference and transformers apply it.

Names: B batch, T sequence, D model width, H heads, N unrotated and R
rotated q/k dimensions per head (Q = N + R), V value width, C and Cq the
key-value and query compressions' widths.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

from models.common import block, layers
from zero_jax.model.hooks import Hooks

LATENT_EPS = 1e-6  # the compressions' RMSNorm epsilon (DeepSeek's, whatever rms_norm_eps says)
LATENT = ("batch", "seq", None)  # a compression: whole on every tensor rank


def rotation(c) -> tuple:
    """(inverse frequencies of the rotated dimensions, the factor they are
    multiplied by, the factor q is multiplied by for the softmax scale)."""
    R = c.qk_rope_head_dim
    if not c.rope_yarn:
        return layers.rope_frequencies(R, c.rope_theta, c.rope_scaling), 1.0, 1.0
    inv, factor = layers.yarn_frequencies(R, c.rope_theta, c.rope_yarn)
    temperature = layers.yarn_mscale(c.rope_yarn[0], c.rope_yarn[5]) if c.rope_yarn[5] else 1.0
    return inv, factor, temperature ** 2


def attention(module: nn.Module, h: Hooks, c, dense: Callable, y_BxTxD, segments_BxT):
    """The block's attention output, (B, T, D). `dense(eq, x, name, shape,
    names)` declares a projection on `module` (FP8 where asked)."""
    D, H = c.d_model, c.n_head
    N, R, V, C, Cq = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank,
                      c.q_lora_rank)
    Q = N + R

    def norm(x, name):
        scale = h.weight(layers.param(module, name, (x.shape[-1],), (None,),
                                      nn.initializers.ones), (None,), jnp.float32)
        return h.act(layers.rms_norm(x, scale, LATENT_EPS), LATENT)

    if Cq:
        q_latent = h.act(norm(dense("btd,dr->btr", y_BxTxD, "w_q_a", (D, Cq), ("embed", None)),
                              "q_a_norm"), LATENT, name="q_latent")
        q = dense("btr,rhq->bthq", q_latent, "w_q_b", (Cq, H, Q), (None, "heads", "kv"))
    else:
        q = dense("btd,dhq->bthq", y_BxTxD, "w_q", (D, H, Q), ("embed", "heads", "kv"))
    compressed = dense("btd,dc->btc", y_BxTxD, "w_kv_a", (D, C + R), ("embed", None))
    kv_latent = h.act(norm(compressed[..., :C], "kv_a_norm"), LATENT, name="kv_latent")
    k_shared = h.act(compressed[..., C:], LATENT, name="kv_latent")
    kv = dense("btc,chq->bthq", kv_latent, "w_kv_b", (C, H, N + V), (None, "heads", "kv"))

    inv_freq, factor, temperature = rotation(c)
    at = h.positions(y_BxTxD.shape[1], segments_BxT)  # laid out over `context`
    if at is None and segments_BxT is not None:
        at = layers.positions(segments_BxT)

    def rotate(x):
        out = layers.rope(x, inv_freq, at)
        return out if factor == 1.0 else (out.astype(jnp.float32) * factor).astype(x.dtype)

    q_rot = rotate(q[..., N:])
    k_rot = jnp.broadcast_to(rotate(k_shared[:, :, None, :]), (*q.shape[:3], R))
    q = jnp.concatenate([q[..., :N], q_rot], -1)
    if temperature != 1.0:  # scores scale with q: the softmax scale times mscale^2
        q = (q.astype(jnp.float32) * temperature).astype(q.dtype)
    heads = ("batch", "seq", "heads", "kv")
    q = h.act(q, heads, name="qkv")
    k = h.act(jnp.concatenate([kv[..., :N], k_rot.astype(kv.dtype)], -1), heads, name="qkv")
    v = h.act(kv[..., N:], heads, name="qkv")
    att_BxTxHxV = block.attend(h, q, k, v, segments_BxT)
    residual = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))
    return dense("bthv,hvd->btd", att_BxTxHxV, "w_o", (H, V, D), ("heads", "kv", "embed"),
                 residual)
