"""The order a sequence is laid out in over the `context` axis.

Under a causal mask, query t attends to t + 1 keys, so contiguous blocks
give the last device c times the first one's work. Cut into 2c chunks,
device i holds chunks i and 2c - 1 - i (the zig-zag, or head-tail, split
of Megatron-LM and torchtitan): each device's pair attends to the same
number of keys, (2c - 1) chunks' worth of work in all.

The step reorders a batch's token arrays once (`arrange`): inputs,
targets, weights and segment ids move together, so the loss, a weighted
sum over tokens, is the same sum. The model never sees natural indices:
each token's position (RoPE's angle, a learned position's row, the causal
and sliding-window masks) is `positions`, its index in the natural order,
restarted at each document under segment ids.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

STRATEGIES = ("all-gather", "ring", "ulysses")


@dataclasses.dataclass(frozen=True)
class Context:
    """How attention crosses the `context` axis, and the sequence's order."""

    strategy: str  # one of STRATEGIES
    size: int  # the axis's size (c)
    balanced: bool = True  # zig-zag order; False: contiguous blocks (natural order)

    def order(self, T: int) -> np.ndarray:
        """For each slot of the laid-out sequence, its natural index."""
        if not self.balanced or self.size == 1:
            return np.arange(T)
        return zigzag(T, self.size)


def zigzag(T: int, c: int) -> np.ndarray:
    """0..T-1 cut into 2c chunks, device i's block chunks i and 2c - 1 - i."""
    if T % (2 * c):
        raise ValueError(f"sequence length {T} does not split into 2 x context = {2 * c} chunks")
    chunks = np.arange(T).reshape(2 * c, T // (2 * c))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * c - 1 - i]]) for i in range(c)])


def arrange(x_BxT: jax.Array, order: np.ndarray | None) -> jax.Array:
    """A (B, T) token array in the laid-out order."""
    return x_BxT if order is None else jnp.take(x_BxT, jnp.asarray(order), axis=1)


def shifted(batch: dict, order: np.ndarray | None) -> dict[str, jax.Array]:
    """A weighted batch (grads.weighted: tokens (B, T + 1), weights (B, T))
    as inputs, targets and weights (B, T), and the inputs' segment ids
    ("segments") if it has them, laid out in `order`."""
    tokens = batch["tokens"]
    out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": batch["weights"]}
    if "segment_ids" in batch:
        out["segments"] = batch["segment_ids"][:, :-1]
    return {k: arrange(v, order) for k, v in out.items()}


def ahead(batch: dict, depth: int, order: np.ndarray | None) -> list[tuple[jax.Array, ...]]:
    """For multi-token prediction depths k = 1..depth, from a weighted
    batch (tokens (B, T + 1), weights (B, T)): at each input position i the
    token k ahead (t_(i+k), what module k embeds), the token k + 1 ahead
    (t_(i+k+1), its target) and that target's weight (zero where the row
    runs out, or where a document ends between i and the target); each
    (B, T), in natural order before they are laid out in `order`, so that
    no shift crosses a device's block of the sequence."""
    tokens, weights = batch["tokens"], batch["weights"]
    T = weights.shape[1]
    out = []
    for k in range(1, depth + 1):
        def padded(x, width=T):
            return jnp.pad(x, ((0, 0), (0, width - x.shape[1])))
        targets, kept = tokens[:, k + 1:], weights[:, k:]
        if "segment_ids" in batch:
            seg = batch["segment_ids"]
            kept = kept * (seg[:, :T - k] == seg[:, k + 1:]).astype(kept.dtype)
        out.append(tuple(arrange(x, order) for x in (padded(tokens[:, k:k + T]), padded(targets),
                                                     padded(kept))))
    return out


def positions(order: np.ndarray | None, T: int, segments_BxT: jax.Array | None):
    """Each laid-out token's position ((1 or B) x T): its natural index, or
    with segment ids (documents numbered in a row, contiguous in natural
    order) its index within its document; None where that is 0..T-1 and
    no masks need it."""
    if order is None:
        if segments_BxT is None:
            return None
        return _within_documents(jnp.arange(T, dtype=jnp.int32)[None], segments_BxT)
    at = jnp.asarray(order, jnp.int32)[None]
    return at if segments_BxT is None else _within_documents(at, segments_BxT)


def _within_documents(at_1xT: jax.Array, segments_BxT: jax.Array) -> jax.Array:
    """Natural indices minus their document's first (the smallest index
    among the row's tokens with the same segment id, in any order)."""
    T = segments_BxT.shape[1]

    def row(seg_T):
        first = jax.ops.segment_min(at_1xT[0], seg_T, num_segments=T + 1)
        return at_1xT[0] - first[seg_T]

    return jax.vmap(row)(segments_BxT.astype(jnp.int32))
