"""One device's stage inside the pipeline loop: what it holds (its chunks of
the layer stack, the embedding and head, the microbatches) and the pieces
every action is built from: running a chunk, the layouts its tensors are
pinned to, and the per-shard split of weight gradients.

Training (train_stage.py) and evaluation (eval_stage.py) build their
actions from these; the loop itself is in executor.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax.model.contract import PipelineFns
from zero_jax.pipeline.records import StagePlan
from zero_jax.sharding.specs import map_specs


def constrain(tree: Any, mesh, specs: Any) -> Any:
    """`tree` pinned to the spec tree `specs` on `mesh`."""
    return jax.lax.with_sharding_constraint(
        tree, map_specs(lambda s: NamedSharding(mesh, s), specs))


def chunks_of(stack: Any, v: int) -> Any:
    """A device's part of the stack, (v * slots, ...) -> (v, slots, ...): its chunks."""
    return jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), stack)


def send(x: jax.Array, pairs) -> jax.Array:
    """x sent over `pairs` (a `ppermute` along `pipe`, every tick, never
    under a conditional: program.py); zeros where nothing is routed."""
    return jax.lax.ppermute(x, "pipe", pairs) if pairs else jnp.zeros_like(x)


@dataclasses.dataclass(frozen=True)
class Held:
    """What one device holds inside the loop: traced, unlike the hooks and
    plans the stage is built with."""

    outer: Any  # the parameters outside the stack: embedding, head (whole, or row blocks)
    chunks: Any  # the device's chunks of the layer stack: (v, slots, ...)
    micro: Any  # the microbatches: inputs, targets and weights, each (m, rows, T)


class LocalStage:
    """A device's chunks, embedding and head, and microbatches, with the
    hooks (and so the mesh) of the loop's inside.

    Activations and their gradients keep the model's layout (batch split).
    Gradients of weights are computed under `vmap` per shard of the batch
    over `where.shard_axes` (as in accumulate.py), so none is reduced over
    those axes inside the loop.
    """

    def __init__(self, fns: PipelineFns, hooks, where: StagePlan, held: Held,
                 x_shape: jax.ShapeDtypeStruct):
        self.fns, self.hooks, self.where = fns, hooks, where
        self.outer, self.chunks, self.micro = held.outer, held.chunks, held.micro
        self.x_zero = jnp.zeros(x_shape.shape, x_shape.dtype)  # "nothing" for a stage's input
        self.shard_hooks = hooks.per_shard(where.shard_axes)
        self.n = where.shards

    @property
    def mesh(self):
        return self.hooks.mesh

    # -- layouts ----------------------------------------------------------
    def act(self, x):
        return self.hooks.act(x, ("batch", "res_seq", "embed"))

    def place(self, buf):
        """A buffer of stage inputs (slots first), laid out as its entries."""
        return self.hooks.act(buf, (None, "batch", "res_seq", "embed"))

    def buffer(self, slots: int) -> jax.Array:
        """A zero buffer of `slots` stage inputs."""
        return self.place(jnp.zeros((slots, *self.x_zero.shape), self.x_zero.dtype))

    def split(self, x):
        """(B, ...) -> (shards, B / shards, ...) for each array of `x`, each
        device's rows in its own entry."""
        spec = PartitionSpec(self.where.shard_axes or None)
        return jax.lax.with_sharding_constraint(
            jax.tree.map(lambda a: a.reshape(self.n, -1, *a.shape[1:]), x),
            NamedSharding(self.mesh, spec))

    def merge(self, x):
        return self.act(x.reshape(-1, *x.shape[2:]))

    def pin(self, tree, specs):
        """A per-shard gradient tree pinned to `specs` behind its shards' axis."""
        def behind_shards(spec):
            return PartitionSpec(self.where.shard_axes or None, *spec)
        return constrain(tree, self.mesh, map_specs(behind_shards, specs))

    # -- inputs -----------------------------------------------------------
    def microbatch(self, i):
        return jax.tree.map(lambda a: a[i], self.micro)

    def row_weights(self, i) -> jax.Array:
        """Each row's share of the batch's targets in microbatch i (B,)."""
        return jnp.sum(self.micro["weights"][i], axis=-1)

    def chunk(self, k):
        """The device's local chunk k of the stack."""
        return jax.tree.map(lambda a: a[k], self.chunks)

    def embed(self, inputs, hooks):
        """The first chunk's input: the embedding of a microbatch's `inputs` (B x T)."""
        return self.act(self.fns.embed(self.outer, inputs, hooks))

    # -- compute ----------------------------------------------------------
    def per_shard(self, f, weights, *rows):
        """`f(weights, *rows)` for each shard: `weights` shared, `rows` split (`split`)."""
        if not self.where.shard_axes:  # one shard: the same program without a vmap
            first = [jax.tree.map(lambda a: a[0], r) for r in rows]
            return jax.tree.map(lambda x: x[None], f(weights, *first))
        return jax.vmap(f, in_axes=(None,) + (0,) * len(rows),
                        spmd_axis_name=self.where.shard_axes)(weights, *rows)

    def run(self, chunk, x, hooks, layers):
        """The chunk's first `layers` slots on x: (output, per-slot
        statistics, PipelineFns.stage). Where the cut has padding, slot by
        slot, each padding slot passing x through (its weights get a zero
        gradient, its statistics are zeros); otherwise the model's own stack
        in one call."""
        stages = self.where.stages
        if stages is None or len(set(stages.counts)) == 1:
            return self.fns.stage(chunk, x, hooks)

        def slot(x, w_i):
            w, i = w_i
            y, stats = self.fns.stage(jax.tree.map(lambda a: a[None], w), x, hooks)
            real = i < layers
            stats = jax.tree.map(lambda s: jnp.where(real, s[0], jnp.zeros((), s.dtype)), stats)
            return jnp.where(real, y, x), stats

        return jax.lax.scan(slot, x, (chunk, jnp.arange(stages.slots)))

    def zero_grads(self, tree, drop: int = 0):
        return jax.tree.map(lambda a: jnp.zeros((self.n, *a.shape[drop:]), self.where.grad_dtype),
                            tree)

    def cast(self, grads):
        """Gradients in the dtype they are accumulated in."""
        return jax.tree.map(lambda g: g.astype(self.where.grad_dtype), grads)
