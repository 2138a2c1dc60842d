"""Attention across the `context` axis, each device holding a block of the
laid-out sequence (layout.py), inside `shard_map` (Hooks.local) over the
axes the batch, the sequence and the heads are split over:

- "all-gather": K and V (and the segment ids) gathered over `context`,
  each device computing its own queries' rows against the whole sequence;
  the gathered copies live for the layer only, and their gradients are
  reduce-scattered back (MaxText's default);
- "ring": K/V blocks passed around the ring (ring.py), never whole on one
  device;
- "ulysses": an all-to-all from the sequence split to a split of the heads
  (DeepSpeed-Ulysses), the model's own attention over the whole sequence on
  a c-th of the heads, in natural order, and back.

The masks are the model's: causal and sliding-window by each token's
natural index, documents by segment id, so every strategy computes what
one device does.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from zero_jax.context import ring
from zero_jax.context.order import Context

PROBS = "attn_probs"  # the models' name for the probabilities (remat policies)


def _named(p):
    return checkpoint_name(p, PROBS)


def attend(hooks, ctx: Context, attention: Callable, q, k, v, window: int, segments_BxT):
    """Causal attention of the laid-out sequence split over `context`;
    `attention(q, k, v, implementation, window, keep, segments_BxT)` is the
    model's one-device attention (Ulysses runs it)."""
    T = q.shape[1]
    order = ctx.order(T)
    axis = hooks.axis_of("seq")
    kv = "kv_heads"
    if hooks.axis_of("kv_heads") != hooks.axis_of("heads"):
        # Too few kv heads to split over `tensor` (they are replicated): each
        # device's query heads get their own copies, split as the heads are.
        H, K = q.shape[2], k.shape[2]
        k, v, kv = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2), "heads"
    names = [("batch", "seq", "heads", "kv"), ("batch", "seq", kv, "kv"),
             ("batch", "seq", kv, "kv")]
    if segments_BxT is not None:
        names.append(("batch", "seq"))
    if ctx.strategy == "ring":
        def ring_attention(q, k, v, seg=None):
            return ring.attention(q, k, v, order, seg, axis=axis, size=ctx.size, window=window)
        fn = ring_attention
    elif ctx.strategy == "all-gather":
        def gathered_attention(q, k, v, seg=None):
            return _gathered(q, k, v, seg, order, axis, window)
        fn = gathered_attention
    else:
        # The model's one-device attention as this layer runs it: its
        # implementation and window fixed, over the whole sequence.
        def whole(q, k, v, keep, segments_BxT):
            return attention(q, k, v, hooks.attention, window, keep=keep,
                             segments_BxT=segments_BxT)

        def ulysses_attention(q, k, v, seg=None):
            return _ulysses(whole, q, k, v, seg, order, axis, ctx.size)
        fn = ulysses_attention
    args = (q, k, v) if segments_BxT is None else (q, k, v, segments_BxT)
    return hooks.local(fn, names, ("batch", "seq", "heads", "kv"))(*args)


def _gathered(q, k, v, seg, order: np.ndarray, axis: str, window: int):
    """This device's queries against K and V gathered over `axis`."""
    T = q.shape[1]
    k_all, v_all = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
    seg_all = None if seg is None else jax.lax.all_gather(seg, axis, axis=1, tiled=True)
    q_idx = jax.lax.dynamic_slice_in_dim(jnp.asarray(order, jnp.int32),
                                         jax.lax.axis_index(axis) * T, T)
    H, K = q.shape[2], k.shape[2]
    k_all, v_all = (jnp.repeat(x, H // K, axis=2) if K != H else x for x in (k_all, v_all))
    scores = jnp.einsum("bthq,bshq->bhts", q, k_all).astype(jnp.float32) / math.sqrt(q.shape[-1])
    seen = ring.visible(q_idx[None], jnp.asarray(order, jnp.int32)[None], seg, seg_all, window)
    scores = jnp.where(seen, scores, ring.NEG)
    probs = _named(jax.nn.softmax(scores, axis=-1).astype(v.dtype))
    return jnp.einsum("bhts,bshq->bthq", probs, v_all)


def _ulysses(attention: Callable, q, k, v, seg, order: np.ndarray, axis: str, size: int):
    """Heads split over `axis` instead of the sequence, the model's attention
    (`attention(q, k, v, keep, segments_BxT)`) on the whole sequence in
    natural order, and back."""
    H, K = q.shape[2], k.shape[2]
    if K % size:  # too few kv heads to split: each query head its own copy
        k, v = (jnp.repeat(x, H // K, axis=2) for x in (k, v))
    natural = jnp.asarray(np.argsort(order))

    def to_heads(x):
        x = jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)
        # Named as q, k and v are (the models' "qkv"): a remat policy that
        # keeps those keeps these, and the backward needs no all-to-all again.
        return checkpoint_name(jnp.take(x, natural, axis=1), "qkv")

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    if seg is not None:
        seg = jnp.take(jax.lax.all_gather(seg, axis, axis=1, tiled=True), natural, axis=1)
    out = attention(q, k, v, keep=_named, segments_BxT=seg)
    out = jnp.take(out, jnp.asarray(order), axis=1)
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
