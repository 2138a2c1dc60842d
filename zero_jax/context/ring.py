"""Ring attention: each device's queries against every device's keys and
values, the K/V blocks passed around the `context` ring with `ppermute`, so
no device ever holds more than two of them (the one it computes with and
the one arriving).

Forward (one device, c steps): at step s it holds the block of device
d - s, sends it on to d + 1 and, while that transfer runs, folds the block
into its queries' online softmax (running max m, normaliser l and
unnormalised output, the log-sum-exp m + log l kept for the backward).
Backward: a second ring passes each block with its gradient accumulators;
a device adds its queries' share of dK and dV to the block it holds and
accumulates dQ, recomputing each block's probabilities from the kept
log-sum-exp (flash attention's backward), and one last step takes every
block's dK and dV home.

Each device's block is two chunks of the sequence (layout.py): queries and
keys are handled in those halves, and a half-block that the mask hides
entirely (by the tokens' natural indices) is skipped under `lax.cond`: with
the zig-zag order, every step but the first computes two of its four
half-blocks, the same two amounts of work on every device.

Scores and softmax are float32, as in the one-device attention; the
products take their inputs in the compute dtype and accumulate in float32.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

NEG = jnp.finfo(jnp.float32).min


def visible(q_idx, k_idx, q_seg, k_seg, window: int):
    """(B|1, 1, Tq, Tk) mask from natural indices and segment ids."""
    i, j = q_idx[:, None, :, None], k_idx[:, None, None, :]
    seen = j <= i
    if window:
        seen = seen & (i - j < window)
    if q_seg is not None:
        seen = seen & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    return seen


def _any_visible(q_idx, k_idx, window: int):
    """Whether any query of a half-block may see any key (a necessary
    condition of `visible`, ignoring segments)."""
    ok = jnp.min(k_idx) <= jnp.max(q_idx)
    if window:
        ok = ok & (jnp.min(q_idx) - jnp.max(k_idx) < window)
    return ok


def _full(shape, fill, like):
    """A float32 constant varying over the manual axes `like` varies over
    (shard_map checks that both branches of a cond agree)."""
    return jnp.full_like(like, fill, shape=shape, dtype=jnp.float32)


def _tied(order, x):
    """`order` and the fills NEG and 0 as values that depend on x.

    The masks and fills of every step depend on constants only (the
    layout's indices, the device's index), so in a layer stack run as a
    scan JAX's partial evaluation hoists them out of the loop as
    loop-invariant: every step's B x H x (T/2)^2 mask and fills computed
    once, before the first layer, and kept through the whole scan. Tied to
    the block's data they are computed where they are used, one step's at
    a time."""
    order, neg, zero, _ = jax.lax.optimization_barrier(
        (order, jnp.float32(NEG), jnp.float32(0.0), x))
    return order, neg, zero


def _repeat(x, groups: int):
    return x if groups == 1 else jnp.repeat(x, groups, axis=2)


def _scores(q, k, scale):
    """(B, H, Tq, Tk) float32 scores of q (B, Tq, H, Q) and k (B, Tk, H, Q)."""
    return jnp.einsum("bthq,bshq->bhts", q, k, preferred_element_type=jnp.float32) * scale


def _halves(x, axis=1):
    n = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, None, axis=axis)


def attention(q, k, v, order, seg, *, axis: str, size: int, window: int):
    """Causal attention of this device's queries q (B, T, H, Q) against the
    keys and values of every device of `axis` (k, v: (B, T, K, Q) here),
    inside `shard_map`. `order` (c T,): the natural index of each slot of
    the laid-out sequence (layout.py); `seg`: this device's segment ids
    (B, T), or None."""
    return _ring(axis, size, window, q, k, v, jnp.asarray(order, jnp.int32), seg)


def _indices(order, origin, T: int):
    """(1, T): the natural indices of device `origin`'s block."""
    return jax.lax.dynamic_slice_in_dim(order, origin * T, T)[None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(axis, size, window, q, k, v, order, seg):
    return _forward(axis, size, window, q, k, v, order, seg)[0]


def _shift(tree, axis: str, size: int):
    """Each device's blocks to the next device of the ring."""
    perm = [(j, (j + 1) % size) for j in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), tree)


def _forward(axis, size, window, q, k, v, order, seg):
    B, T, H, Q = q.shape
    groups, scale = H // k.shape[2], 1.0 / math.sqrt(Q)
    d = jax.lax.axis_index(axis)
    order, neg, zero = _tied(order, q)
    qs = list(zip(_halves(q), _halves(_indices(order, d, T)),
                  _halves(seg) if seg is not None else (None,) * 2))

    def fold(state, block, s):
        """The half-blocks of one K/V block, device d - s's, folded into
        each query half's (m, l, acc)."""
        kb, vb, ksb = block
        kib = _indices(order, (d - s) % size, T)
        ks = list(zip(_halves(kb), _halves(vb), _halves(kib),
                      _halves(ksb) if ksb is not None else (None,) * 2))
        out = []
        for (qh, qih, qsh), (m, l, acc) in zip(qs, state):
            for kh, vh, kih, ksh in ks:
                def update(m, l, acc, kh=kh, vh=vh, kih=kih, ksh=ksh):
                    s = _scores(qh, _repeat(kh, groups), scale)
                    seen = visible(qih, kih, qsh, ksh, window)
                    s = jnp.where(seen, s, neg)
                    m_new = jnp.maximum(m, s.max(-1))
                    p = jnp.where(seen, jnp.exp(s - m_new[..., None]), zero)
                    corr = jnp.exp(m - m_new)
                    l_new = l * corr + p.sum(-1)
                    pv = jnp.einsum("bhts,bshq->bthq", p.astype(vh.dtype), _repeat(vh, groups),
                                    preferred_element_type=jnp.float32)
                    acc_new = acc * jnp.swapaxes(corr, 1, 2)[..., None] + pv
                    return m_new, l_new, acc_new
                m, l, acc = jax.lax.cond(_any_visible(qih, kih, window), update,
                                         lambda m, l, acc: (m, l, acc), m, l, acc)
            out.append((m, l, acc))
        return out

    Th = T // 2
    state = [(_full((B, H, Th), NEG, q), _full((B, H, Th), 0.0, q),
              _full((B, Th, H, v.shape[-1]), 0.0, q))  # values may be narrower (latent attention)
             for _ in range(2)]
    block = (k, v, seg)

    def step(carry, s):
        state, block = carry
        arriving = _shift(block, axis, size)  # sent before, and while, this block is folded
        return (fold(state, block, s), arriving), None

    (state, block), _ = jax.lax.scan(step, (state, block), jnp.arange(size - 1))
    state = fold(state, block, size - 1)
    outs, lses = [], []
    for m, l, acc in state:
        outs.append(acc / jnp.swapaxes(l, 1, 2)[..., None])
        lses.append(m + jnp.log(l))
    # Named as the attention's output (the models' "attn_ctx"), so that a
    # remat policy keeping it keeps what this backward needs, instead of
    # running the forward ring again.
    out = checkpoint_name(jnp.concatenate(outs, axis=1).astype(q.dtype), "attn_ctx")
    lse = checkpoint_name(jnp.concatenate(lses, axis=2), "attn_ctx")  # (B, H, T)
    return out, (q, k, v, order, seg, out, lse)


class _QueryHalf(NamedTuple):
    """Half of this device's queries, with what their backward reads."""

    q: jax.Array  # (B, T/2, H, Q)
    idx: jax.Array  # (1, T/2): their natural indices
    seg: jax.Array | None  # (B, T/2): their segment ids
    dout: jax.Array  # the output's gradient
    lse: jax.Array  # (B, H, T/2): the forward's log-sum-exp
    delta: jax.Array  # (B, H, T/2): each query's dout . out (flash attention's D)


class _KeyHalf(NamedTuple):
    """Half of a K/V block passed round the ring."""

    k: jax.Array  # (B, T/2, K, Q)
    v: jax.Array  # (B, T/2, K, Q)
    idx: jax.Array  # (1, T/2): their natural indices
    seg: jax.Array | None  # (B, T/2): their segment ids


def _ring_bwd(axis, size, window, res, dout):
    q, k, v, order, seg, out, lse = res
    B, T, H, Q = q.shape
    K = k.shape[2]
    groups, scale = H // K, 1.0 / math.sqrt(Q)
    d = jax.lax.axis_index(axis)
    order, _, zero = _tied(order, dout)
    delta = jnp.einsum("bthq,bthq->bht", dout.astype(jnp.float32), out.astype(jnp.float32))
    qs = [_QueryHalf(*h) for h in zip(_halves(q), _halves(_indices(order, d, T)),
                                      _halves(seg) if seg is not None else (None,) * 2,
                                      _halves(dout), _halves(lse, 2), _halves(delta, 2))]

    def fold(dq, block, dkv, s):
        """This device's queries' gradients against one K/V block (device
        d - s's): dQ here, dK and dV added to the block's accumulators."""
        kb, vb, ksb = block
        kib = _indices(order, (d - s) % size, T)
        ks = [_KeyHalf(*h) for h in zip(_halves(kb), _halves(vb), _halves(kib),
                                        _halves(ksb) if ksb is not None else (None,) * 2)]
        dks, dvs = [list(_halves(dkv[0])), list(_halves(dkv[1]))]
        dqs = list(_halves(dq))
        for a, query in enumerate(qs):
            for b, key in enumerate(ks):
                def grads(dq, dk, dv, query=query, key=key):
                    qh, qih, qsh, doh, lseh, dh = query
                    kh, vh, kih, ksh = key
                    kr, vr = _repeat(kh, groups), _repeat(vh, groups)
                    s = _scores(qh, kr, scale)
                    seen = visible(qih, kih, qsh, ksh, window)
                    p = jnp.where(seen, jnp.exp(s - lseh[..., None]), zero)  # (B, H, Tq, Tk)
                    dv_r = jnp.einsum("bhts,bthq->bshq", p.astype(doh.dtype), doh,
                                      preferred_element_type=jnp.float32)
                    dp = jnp.einsum("bthq,bshq->bhts", doh, vr, preferred_element_type=jnp.float32)
                    ds = p * (dp - dh[..., None]) * scale
                    dq = dq + jnp.einsum("bhts,bshq->bthq", ds.astype(kr.dtype), kr,
                                         preferred_element_type=jnp.float32)
                    dk_r = jnp.einsum("bhts,bthq->bshq", ds.astype(qh.dtype), qh,
                                      preferred_element_type=jnp.float32)
                    fold_heads = lambda x: x.reshape(*x.shape[:2], K, groups, x.shape[-1]).sum(3)
                    return dq, dk + fold_heads(dk_r), dv + fold_heads(dv_r)
                dqs[a], dks[b], dvs[b] = jax.lax.cond(
                    _any_visible(query.idx, key.idx, window), grads,
                    lambda dq, dk, dv: (dq, dk, dv), dqs[a], dks[b], dvs[b])
        return (jnp.concatenate(dqs, axis=1),
                (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)))

    dq = _full(q.shape, 0.0, q)
    dkv = (_full(k.shape, 0.0, k), _full(v.shape, 0.0, v))
    block = (k, v, seg)

    def step(carry, s):
        dq, block, dkv = carry
        arriving = _shift(block, axis, size)
        dq, dkv = fold(dq, block, dkv, s)
        return (dq, arriving, _shift(dkv, axis, size)), None

    (dq, block, dkv), _ = jax.lax.scan(step, (dq, block, dkv), jnp.arange(size - 1))
    dq, dkv = fold(dq, block, dkv, size - 1)
    dk, dv = _shift(dkv, axis, size)  # each block's gradients home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_forward, _ring_bwd)
