"""How a pipeline cuts the layer stack: contiguous stages balanced with the
embedding and the head counted, stored in fixed-size slots.

The stack's L layers are cut into G = p * v chunks of consecutive layers;
device d (a `pipe` index) runs chunks d, d + p, ... (schedule.py). The first
chunk also runs the embedding and the last the head, and each counts as one
layer, as BLOOM's partition counted them: 70 layers on 12 stages become
5, 6, ..., 6, 5, so that every stage does the work of six.

In one SPMD program every device holds the same shapes, so each chunk has
S slots (its largest layer count). The stack is stored as G * S slots in
device order, device d's chunks consecutive, so splitting the slot
dimension over `pipe` gives each device its own chunks with no exchange
inside the step. A slot past its chunk's layer count is padding: the
pipeline passes its input through unchanged, its gradient is zero, and it
holds zeros. Checkpoints hold the stack in layer order without padding
(`unpad`), so they restore onto any layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Stages:
    """A stack of `layers` cut into p * v chunks of `counts[g]` layers each."""

    layers: int  # L
    p: int  # pipeline stages (devices along `pipe`)
    v: int  # chunks per device
    counts: tuple[int, ...]  # layers of global chunk g = k * p + d

    @property
    def chunks(self) -> int:
        return self.p * self.v

    @property
    def slots(self) -> int:
        """Layer slots per chunk (S)."""
        return max(self.counts)

    @property
    def padded(self) -> int:
        """Length of the stored slot dimension: G * S."""
        return self.chunks * self.slots

    @property
    def first_layer(self) -> tuple[int, ...]:
        """Index of each chunk's first layer."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.counts)[:-1]]))

    @property
    def identity(self) -> bool:
        """Whether the stored slots are the layers in order, unpadded."""
        return self.v == 1 and len(set(self.counts)) == 1

    def slot_layers(self) -> np.ndarray:
        """For each stored slot, the layer it holds, or -1 for padding.

        Slot (d * v + k) * S + s holds layer s of global chunk k * p + d.
        """
        out = np.full(self.padded, -1, np.int32)
        first = self.first_layer
        for d in range(self.p):
            for k in range(self.v):
                g = k * self.p + d
                base = (d * self.v + k) * self.slots
                out[base:base + self.counts[g]] = np.arange(first[g], first[g] + self.counts[g])
        return out

    def device_counts(self) -> np.ndarray:
        """(p, v): layers of device d's local chunk k."""
        return np.array([[self.counts[k * self.p + d] for k in range(self.v)]
                         for d in range(self.p)], np.int32)

    # -- between the stored slots and layer order --------------------------
    def pad(self, x: jax.Array) -> jax.Array:
        """(L, ...) in layer order -> (G * S, ...) stored slots, zeros in the padding."""
        if self.identity:
            return x
        idx = self.slot_layers()
        rows = jnp.take(x, jnp.asarray(np.maximum(idx, 0)), axis=0)
        keep = jnp.asarray(idx >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(keep, rows, jnp.zeros((), x.dtype))

    def unpad(self, x: jax.Array) -> jax.Array:
        """(G * S, ...) stored slots -> (L, ...) in layer order."""
        if self.identity:
            return x
        where = np.argsort(np.where(self.slot_layers() < 0, self.padded, self.slot_layers()),
                           kind="stable")[:self.layers]
        return jnp.take(x, jnp.asarray(where), axis=0)


def balanced(layers: int, p: int, v: int = 1, ends: int = 1) -> Stages:
    """Contiguous chunks whose largest work (layers, plus `ends` for the
    embedding and for the head) is as small as it can be, and among those
    the fewest slots per chunk (the least padding).

    The bound is ceil((L + 2 ends) / G) layers of work per chunk. A chunk can
    take that many layers, less `ends` at either end of the stack; with S
    slots, at most S. The smallest S whose capacities add up to L is used,
    and chunks above L's share give layers back, last chunks first.
    """
    G = p * v
    if layers < G:
        raise ValueError(f"{layers} layers cannot fill {p} stages x {v} chunks: use pipe x "
                         f"virtual stages <= {layers}")
    work = -(-(layers + 2 * ends) // G)
    cap = [work - ends * ((g == 0) + (g == G - 1)) for g in range(G)]
    cap = [max(c, 1) for c in cap]
    slots = -(-layers // G)
    while sum(min(slots, c) for c in cap) < layers:
        slots += 1
    counts = [min(slots, c) for c in cap]
    extra = sum(counts) - layers
    for g in sorted(range(G), key=lambda g: (-counts[g], -g)):
        if extra == 0:
            break
        if counts[g] > 1:
            counts[g] -= 1
            extra -= 1
    return Stages(layers, p, v, tuple(counts))
