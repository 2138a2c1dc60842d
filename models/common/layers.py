"""Numerics shared by the reference models: norms, activations, rotary
embeddings, attention, and how a parameter is declared.

What the backward pass keeps is decided by the remat policy over the named
activations (zero_jax.model.remat); norm and activation internals are unnamed and
so recomputed. Softmax has its own backward rule that needs only its output,
in the compute dtype, so the scores before it are never kept either.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax.model import fp8, lora

# Attention implementations: "xla", the computation written out below, which
# materialises the T x T scores; "cudnn", jax.nn.dot_product_attention's fused
# cuDNN kernel, which does not.
ATTENTION = ("xla", "cudnn")


def param(module: nn.Module, name: str, shape, names, init):
    """A float32 parameter of `module` named with logical axes."""
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


def projection(module: nn.Module, hooks, eq: str, x, name: str, shape, names, init):
    """einsum(eq, x, w) for a block's projection, w the parameter `name`: in
    FP8 where the precision policy says so, with its amax history beside
    it under delayed scaling (zero_jax.model.fp8); with a low-rank adapter's
    term where the hooks' LoRA targets it (zero_jax.model.lora)."""
    xs, ws = eq.split("->")[0].split(",")
    if ws[0] not in xs:  # LoRA's quantized base blocks along it (zero_jax/model/base_quant.py)
        raise ValueError(f"projection {name} ({eq}): a block projection's weight takes its "
                         "input dimension first")
    history = None
    if hooks.fp8 == "delayed":
        history = module.param(fp8.history_name(name),
                               nn.with_logical_partitioning(nn.initializers.zeros, (None, None)),
                               (fp8.ROWS, hooks.fp8_history), jnp.float32)
    y = hooks.dense(eq, x, param(module, name, shape, names, init), names, fp8=True,
                    history=history)
    return lora.adapted(module, hooks, eq, x, name, shape, names, y)


def attention(q_BxTxHxQ, k_BxSxKxQ, v_BxSxKxQ, implementation: str = "xla", window: int = 0,
              keep: Callable = lambda probs: probs, segments_BxT=None):
    """Causal scaled dot-product attention, grouped when K < H key/value
    heads (each serves H / K query heads); `window` > 0 lets each query see
    only the last `window` positions, itself included (Mistral's sliding
    window); with `segments_BxT` (documents packed in a row, numbered) each
    query sees its own document only. Scores and softmax are float32
    whatever the inputs' dtype.

    "cudnn" calls `jax.nn.dot_product_attention`'s cuDNN kernel. "xla" is
    the computation its XLA implementation performs, written out: that
    implementation asks for float16 x float16 -> float32 products, which
    XLA:CPU cannot lower ("F16_F16_F32 is not supported by dot_general on
    CPU"), and its bf16 products round differently under vmap, which would
    make layouts disagree. Written out, the probabilities pass through
    `keep` (the model names them for the remat policy, `attn_probs`)."""
    if implementation not in ATTENTION:
        raise ValueError(f"attention {implementation!r}: choose from {', '.join(ATTENTION)}")
    if implementation == "cudnn":
        if segments_BxT is not None:  # job.attention_implementation picks xla for them
            raise ValueError("attention cudnn: document masking (segment ids) is written for "
                             "the xla implementation only; use --attention xla")
        return jax.nn.dot_product_attention(
            q_BxTxHxQ, k_BxSxKxQ, v_BxSxKxQ, is_causal=True, implementation="cudnn",
            local_window_size=(window - 1, 0) if window else None)
    H, K = q_BxTxHxQ.shape[2], k_BxSxKxQ.shape[2]
    k, v = (jnp.repeat(t, H // K, axis=2) if K != H else t for t in (k_BxSxKxQ, v_BxSxKxQ))
    T, S = q_BxTxHxQ.shape[1], k.shape[1]
    scores = scores_bhts(q_BxTxHxQ, k).astype(jnp.float32)
    scores = scores / math.sqrt(q_BxTxHxQ.shape[-1])
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    if segments_BxT is not None:
        visible = visible & (segments_BxT[:, None, :, None] == segments_BxT[:, None, None, :])
    # The mask is added as a bias of the visible pattern's shape (T x S, or B
    # x 1 x T x S with segments) rather than selected: the sum's gradient is
    # the incoming one, where a select's backward materialises a zero tensor
    # of the scores' full B x H x T x S shape. Visible scores are unchanged
    # (+ 0); hidden ones go to the float32 minimum or -inf, 0 after softmax.
    scores = scores + jnp.where(visible, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
    probs = softmax(scores, v.dtype, keep)
    return jnp.einsum("bhts,bshq->bthq", probs, v)


@jax.custom_vjp
def scores_bhts(q_BxTxHxQ, k_BxSxHxQ):
    """q . k over the head dimension, B x H x T x S, in the inputs' dtype."""
    return jnp.einsum("bthq,bshq->bhts", q_BxTxHxQ, k_BxSxHxQ)


def _scores_fwd(q_BxTxHxQ, k_BxSxHxQ):
    return scores_bhts(q_BxTxHxQ, k_BxSxHxQ), (q_BxTxHxQ, k_BxSxHxQ)


def _scores_bwd(res, g_BxHxTxS):
    """The keys' gradient sums g over its rows (t): written as g^T q, its
    product reads g across its layout, which a matmul library takes as a
    transposed operand (XLA:CPU then leaves its fast kernels for its
    generic dot, at twice the time); written as (q^T g)^T, the product reads g as
    laid out and q, a head-dimension's width, transposed. Same sums, same
    bytes; the result is transposed back to k's layout, a copy of k's size
    that the gradient's concatenation with q's and v's takes in."""
    q, k = res
    dq = jnp.einsum("bhts,bshq->bthq", g_BxHxTxS, k)
    dk_BxHxQxS = jnp.einsum("bthq,bhts->bhqs", q, g_BxHxTxS)
    return dq.astype(q.dtype), jnp.transpose(dk_BxHxQxS, (0, 3, 1, 2)).astype(k.dtype)


scores_bhts.defvjp(_scores_fwd, _scores_bwd)


def attention_probs(heads: int, seq_len: int, rows: int, tensor: int, implementation: str,
                    context: int = 1, strategy: str = "") -> float:
    """Elements per device of one layer's attention probabilities, which the
    model names (`attn_probs`) and remat policies keep or rebuild like any
    named activation; none under cuDNN's kernel, which keeps row statistics.
    Over `context` (zero_jax/context): each device's queries' rows against
    every key (all-gather), or every row of a c-th of the heads (ulysses),
    a c-th either way; none under ring attention, whose blocks live one at
    a time and whose backward recomputes them."""
    if strategy == "ring" or (implementation == "cudnn" and strategy != "all-gather"):
        return 0.0
    return heads * seq_len * seq_len * rows / tensor / context


def rms_norm(x, scale, eps: float):
    """RMSNorm computed in float32, returned in x's dtype."""
    h = x.astype(jnp.float32)
    y = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: tuple | None = None):
    """Inverse frequencies of rotary embeddings, one per pair of dimensions
    (Hugging Face's half-rotation layout pairs i with i + head_dim / 2).
    `scaling`: Llama 3's (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings): long wavelengths divided by
    `factor`, short ones kept, a smooth blend between."""
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if not scaling:
        return inv
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return jnp.where(wavelen > original / low, inv / factor,
                     jnp.where(wavelen < original / high, inv, blended))


def yarn_frequencies(head_dim: int, theta: float, yarn: tuple) -> tuple[jax.Array, float]:
    """Inverse frequencies under YaRN (Peng et al. 2023) as DeepSeek-V3 and
    transformers compute them, and the factor the rotated dimensions are
    multiplied by. `yarn`: (factor, original_max_position_embeddings,
    beta_fast, beta_slow, mscale, mscale_all_dim). Dimensions that turn
    more than beta_fast times over the original length keep their
    frequency, those under beta_slow are divided by `factor`, a linear
    ramp between (its ends rounded outwards, as transformers' `truncate`)."""
    factor, original, beta_fast, beta_slow, mscale, mscale_all_dim = yarn
    base = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)

    def turns_to_dim(turns):
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(turns_to_dim(beta_fast)), 0)
    high = min(math.ceil(turns_to_dim(beta_slow)), head_dim - 1)
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low)
                    / ((high - low) or 0.001), 0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: divided by factor
    inv = (1 / (factor * base)) * (1 - keep) + (1 / base) * keep
    scale = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
             if mscale and mscale_all_dim else yarn_mscale(factor))
    return inv, float(scale)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 m ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def positions(segments_BxT):
    """Each token's position within its document, the documents of a row
    numbered in order (segment ids): positions restart at every document."""
    T = segments_BxT.shape[1]
    i = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments_BxT[:, :1], bool),
                              segments_BxT[:, 1:] != segments_BxT[:, :-1]], axis=1)
    return i - jax.lax.cummax(jnp.where(starts, i, 0), axis=1)


def rope(x_BxTxHxQ, inv_freq, positions_BxT=None):
    """Rotary embedding of positions 0..T-1 (or `positions_BxT`), in float32,
    returned in x's dtype."""
    T, Q = x_BxTxHxQ.shape[1], x_BxTxHxQ.shape[-1]
    at = jnp.arange(T)[None] if positions_BxT is None else positions_BxT
    angles = at.astype(jnp.float32)[..., None] * inv_freq  # (B or 1) x T x Q/2
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :]
    h = x_BxTxHxQ.astype(jnp.float32)
    rotated = jnp.concatenate([-h[..., Q // 2:], h[..., :Q // 2]], -1)
    return (h * cos + rotated * sin).astype(x_BxTxHxQ.dtype)


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


def softmax(x, dtype, keep: Callable = lambda p: p):
    """Softmax over the last axis computed in float32, returned in `dtype`
    through `keep` (a model names the probabilities with it for the remat
    policy). The backward reads those kept probabilities: they enter
    `_softmax_grad` as an input, so a policy that keeps them by name keeps
    the backward's residual too, instead of recomputing the scores and the
    softmax to rebuild it."""
    p = keep(jax.lax.stop_gradient(jax.nn.softmax(x.astype(jnp.float32), axis=-1)).astype(dtype))
    return _softmax_grad(x, p)


@jax.custom_vjp
def _softmax_grad(x, p):
    """`p`, whose gradient flows to `x` as softmax's, in float32."""
    return p


def _softmax_grad_fwd(x, p):
    return p, (p, jnp.zeros((0,), x.dtype))


def _softmax_grad_bwd(res, g):
    p, like = res
    p32, g32 = p.astype(jnp.float32), g.astype(jnp.float32)
    dx = p32 * (g32 - jnp.sum(g32 * p32, axis=-1, keepdims=True))
    return dx.astype(like.dtype), jnp.zeros_like(p)


_softmax_grad.defvjp(_softmax_grad_fwd, _softmax_grad_bwd)
