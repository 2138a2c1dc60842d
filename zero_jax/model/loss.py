"""Next-token cross-entropy that never gathers the logits over the vocabulary.

The target logit is picked with a comparison against an iota instead of a
gather, so with the vocabulary split over `tensor` each device reduces its
own slice and only (B, T) partial sums cross devices; the same holds with
the vocabulary split over a manual axis (`vocab_axis`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, weights_BxT: jax.Array,
                  vocab_axis: str | None = None) -> jax.Array:
    """Negative log-likelihood in nats, computed in float32: each target's
    weighted by its weight and summed (grads.weighted: the weights of a
    whole batch sum to one, so the sum over all its parts is the mean).

    `vocab_axis`: inside `shard_map`, the manual mesh axis over which the
    vocabulary is split in contiguous blocks (hooks.RowSplit): the logits
    are this device's block, and the maximum, the normaliser and the target
    logit are combined over the axis as (B, T) values.
    """
    logits = logits_BxTxV.astype(jnp.float32)
    V = logits.shape[-1]
    vocab_V = jnp.arange(V, dtype=targets_BxT.dtype)
    if vocab_axis is None:
        logz_BxT = jax.nn.logsumexp(logits, axis=-1)
    else:
        vocab_V = vocab_V + jax.lax.axis_index(vocab_axis).astype(targets_BxT.dtype) * V
        # pmax has no derivative; the peak only steadies exp, so none is needed.
        peak_BxT = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), vocab_axis)
        total_BxT = jax.lax.psum(jnp.sum(jnp.exp(logits - peak_BxT[..., None]), axis=-1), vocab_axis)
        logz_BxT = jnp.log(total_BxT) + peak_BxT
    picked_BxT = jnp.sum(jnp.where(vocab_V == targets_BxT[..., None], logits, 0.0), axis=-1)
    if vocab_axis is not None:
        picked_BxT = jax.lax.psum(picked_BxT, vocab_axis)
    nll_BxT = logz_BxT - picked_BxT
    return jnp.sum(nll_BxT * weights_BxT)


def expert_load_ratio(counts_LxE: jax.Array) -> jax.Array:
    """Per layer of a mixture of experts, the busiest expert's share of the
    routed tokens over the mean share (1: balanced; E: all to one expert)."""
    return jnp.max(counts_LxE, -1) / jnp.maximum(jnp.mean(counts_LxE, -1), 1e-9)
