"""What a device does at one tick of the training loop, and how the result
is written into the loop's carry.

Each tick a device runs one of three actions, chosen by its program row
(program.py): nothing, a forward (F) of one microbatch through one of its
chunks, or a backward (B). Every action returns the same `Tick` record,
zeros where it made nothing, because `lax.switch` needs one output type and
because then writing it back (`record`) is the same for all three: values
are written under the action's kind, and the sends (`ppermute`) happen on
every device alike, as collectives must.

A forward keeps only its chunk's input (the stash); the backward recomputes
the chunk's forward from it (activation checkpointing at chunk granularity).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

from zero_jax.loss import cross_entropy
from zero_jax.pipeline.program import BWD, FWD, Row, Tables
from zero_jax.pipeline.stage import LocalStage

if TYPE_CHECKING:
    from zero_jax.pipeline.executor import PipelineFns, StageLayout


class Tick(NamedTuple):
    """What one device's action at one tick produces (zeros where it has none)."""

    stash: jax.Array  # F: its input, kept for its backward
    to_next: jax.Array  # F: its output, for the next stage
    to_prev: jax.Array  # B: the gradient of its input, for the previous stage
    loss_grad: jax.Array  # F of the last chunk: the loss gradient its backward starts from
    chunk_grads: Any  # B: gradients of the chunk's weights, per shard
    outer_grads: Any  # embedding (B of the first chunk) and head (F of the last) gradients, per shard
    loss: jax.Array  # F of the last chunk: the microbatch's loss, per shard


class Carry(NamedTuple):
    """The training loop's state from tick to tick, on one device.

    The fields are in name order: the `fori_loop`'s tuple follows them, and
    XLA's buffer assignment follows that tuple, so another order compiles
    to the same instructions with slightly different temp bytes."""

    bwd: jax.Array  # backward inbox: gradients waiting for their B (one spare slot)
    fwd: jax.Array  # forward inbox: activations waiting for their F (one spare slot)
    g_outer: Any  # embedding and head gradients, per shard
    g_stack: Any  # the chunks' weight gradients, per shard: (shards, v, slots, ...)
    loss: jax.Array  # loss sums, per shard
    stash: jax.Array  # F's inputs, kept for their B


class TrainStage(LocalStage):
    """A device's stage in the training loop: `loss_scale` multiplies the
    loss its gradients are taken of."""

    def __init__(self, fns: PipelineFns, hooks, where: StageLayout, outer, chunks, micro,
                 x_shape: jax.ShapeDtypeStruct, loss_scale: jax.Array):
        super().__init__(fns, hooks, where, outer, chunks, micro, x_shape)
        self.loss_scale = loss_scale

    def loop(self, tables: Tables) -> Carry:
        """The carry after every tick of the program in `tables`."""
        d = jax.lax.axis_index("pipe")

        def tick(t, c):
            row = tables.at(t, d)
            out = jax.lax.switch(row.kind, [self.nothing, self.forward, self.backward], c, row)
            return self.record(c, row, out, tables.p)

        return jax.lax.fori_loop(0, tables.ticks, tick, self.start(tables.slots))

    def start(self, slots: tuple[int, int, int]) -> Carry:
        n_stash, n_fwd, n_bwd = slots
        # Inboxes have one spare slot, where "nothing arrived" is written.
        return Carry(fwd=self.buffer(n_fwd + 1), bwd=self.buffer(n_bwd + 1),
                     stash=self.buffer(n_stash),
                     g_stack=self.pin(self.zero_grads(self.chunks), self.where.stage_grads),
                     g_outer=self.pin(self.zero_grads(self.outer), self.where.outer_grads),
                     loss=self.no_loss())

    def no_loss(self) -> jax.Array:
        """A loss of zero per shard: what an action without the head adds."""
        return jnp.zeros((self.n,), jnp.float32)

    def nothing(self, c: Carry, row: Row) -> Tick:
        x = self.x_zero
        return Tick(x, x, x, x, self.zero_grads(self.chunks, drop=1), self.zero_grads(self.outer),
                    self.no_loss())

    # -- forward: embed (first chunk), one chunk, loss (last chunk) ---------
    def forward(self, c: Carry, row: Row) -> Tick:
        mb = self.microbatch(row.mb)
        x = jax.lax.cond(row.first, lambda: self.embed(mb["tokens"], self.hooks),
                         lambda: self.act(c.fwd[row.read]))
        y = self.act(self.run(self.chunk(row.chunk), x, self.hooks, row.layers))

        def no_head():
            return self.no_loss(), self.zero_grads(self.outer), self.x_zero

        loss, g_o, dy = jax.lax.cond(row.last, lambda: self.head(y, mb), no_head)
        return Tick(stash=x, to_next=jnp.where(row.last, self.x_zero, y), to_prev=self.x_zero,
                    loss_grad=dy, chunk_grads=self.zero_grads(self.chunks, drop=1),
                    outer_grads=g_o, loss=loss)

    def head(self, y, mb) -> tuple[jax.Array, Any, jax.Array]:
        """The last chunk's end: per shard, the loss of output y, the head's
        gradients, and the loss gradient the backward starts from."""
        def head_loss(outer, y, mb):
            # Each shard's weighted sum (step.weighted): the shards' and
            # microbatches' sum is the batch's mean.
            logits = self.fns.head(outer, y, self.shard_hooks)
            return cross_entropy(logits, mb["tokens"][:, 1:], mb["weights"]) * self.loss_scale

        loss, (g_o, dy) = self.per_shard(
            jax.value_and_grad(head_loss, argnums=(0, 1)), self.outer, self.split(y),
            self.split(mb))
        return loss, self.cast(g_o), self.merge(dy)

    # -- backward: one chunk, then the embedding (first chunk) --------------
    def backward(self, c: Carry, row: Row) -> Tick:
        h = self.shard_hooks
        chunk = self.chunk(row.chunk)
        x, dy = c.stash[row.stash], c.bwd[row.read]

        def chunk_vjp(chunk, x, dy):
            return jax.vjp(lambda w, x: self.run(w, x, h, row.layers), chunk, x)[1](dy)

        g_chunk, dx = self.per_shard(chunk_vjp, chunk, self.split(x), self.split(dy))
        g_o = jax.lax.cond(row.first, lambda: self.embed_grads(row.mb, dx),
                           lambda: self.zero_grads(self.outer))
        dx = self.merge(dx)
        return Tick(stash=self.x_zero, to_next=self.x_zero,
                    to_prev=jnp.where(row.first, self.x_zero, dx), loss_grad=self.x_zero,
                    chunk_grads=self.cast(g_chunk), outer_grads=g_o, loss=self.no_loss())

    def embed_grads(self, mb, dx) -> Any:
        """The embedding's gradients, per shard, for microbatch `mb`, from
        dx: the gradient of the first chunk's input, split per shard."""
        def embed_vjp(outer, tokens, dx):
            return jax.vjp(lambda o: self.fns.embed(o, tokens[:, :-1], self.shard_hooks),
                           outer)[1](dx)[0]
        tokens = self.split(self.microbatch(mb)["tokens"])
        return self.cast(self.per_shard(embed_vjp, self.outer, tokens, dx))

    # -- the buffers a tick writes ------------------------------------------
    def record(self, c: Carry, row: Row, out: Tick, p: int) -> Carry:
        """The carry after the tick: stash, loss gradient and weight gradients
        written in place (only where this tick's action made them), then
        activations sent one stage on and gradients one stage back."""
        is_f, is_b = row.kind == FWD, row.kind == BWD
        stash = c.stash.at[row.stash].set(jnp.where(is_f, out.stash, c.stash[row.stash]))
        bwd_box = c.bwd.at[row.dy].set(jnp.where(is_f & row.last, out.loss_grad, c.bwd[row.dy]))

        def add_chunk(acc, g):
            return acc.at[:, row.chunk].add(jnp.where(is_b, g, jnp.zeros_like(g)))

        g_stack = jax.tree.map(add_chunk, c.g_stack, out.chunk_grads)
        to_next = jax.lax.ppermute(out.to_next, "pipe", [(i, (i + 1) % p) for i in range(p)])
        to_prev = jax.lax.ppermute(out.to_prev, "pipe", [(i, (i - 1) % p) for i in range(p)])
        return Carry(
            stash=self.place(stash),
            fwd=self.place(c.fwd.at[row.fwd_arrival].set(to_next)),
            bwd=self.place(bwd_box.at[row.bwd_arrival].set(to_prev)),
            g_stack=self.pin(g_stack, self.where.stage_grads),
            g_outer=self.pin(jax.tree.map(jnp.add, c.g_outer, out.outer_grads),
                             self.where.outer_grads),
            loss=c.loss + out.loss,
        )
