"""What a device does at one tick of the training loop, written into the
loop's carry.

A tick is fused (schedule.py): a device runs its forward (F) if it has one,
then its backward (B), then its weight gradients (W, under a split
backward), each under `lax.cond` on its program row (program.py), so a part
the device does not have costs nothing: it computes nothing and adds
nothing to the accumulators. Each part writes its results into the carry
itself and returns the message it sends (zeros if none). Then the sends:
over the tick's pair list only (`send`), a collective every device runs
alike since the list is the tick's.

A forward keeps only its chunk's input (the stash); the backward recomputes
the chunk's forward from it (activation checkpointing at chunk
granularity). A split backward keeps, for its W, each matrix product's
input and output gradient (weight_grad.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from zero_jax.loss import cross_entropy
from zero_jax.pipeline.program import Row, Tables
from zero_jax.pipeline.schedule import W_PER_TICK
from zero_jax.pipeline.stage import LocalStage, send
from zero_jax.pipeline.weight_grad import SplitBackward

if TYPE_CHECKING:
    from zero_jax.pipeline.executor import PipelineFns, StageLayout


class Carry(NamedTuple):
    """The training loop's state from tick to tick, on one device.

    The fields are in name order: the `fori_loop`'s tuple follows them, and
    XLA's buffer assignment follows that tuple, so another order compiles
    to the same instructions with slightly different temp bytes."""

    bwd: jax.Array  # gradient inbox: gradients waiting for their B (one spare slot)
    fwd: jax.Array  # forward inbox: activations waiting for their F (one spare slot)
    g_outer: Any  # embedding and head gradients, per shard
    g_stack: Any  # the chunks' weight gradients, per shard: (shards, v, slots, ...)
    keep: Any  # split backward: what each waiting W needs, per W slot and shard
    loss: jax.Array  # loss sums, per shard
    stash: jax.Array  # F's inputs, kept for their B


class TrainStage(LocalStage):
    """A device's stage in the training loop: `loss_scale` multiplies the
    loss its gradients are taken of; with `split`, backwards give the input
    gradient and Ws the matrices' gradients."""

    def __init__(self, fns: PipelineFns, hooks, where: StageLayout, outer, chunks, micro,
                 x_shape: jax.ShapeDtypeStruct, loss_scale: jax.Array, split: bool = False):
        super().__init__(fns, hooks, where, outer, chunks, micro, x_shape)
        self.loss_scale = loss_scale
        self.split_bwd = None
        if split:
            rows = jax.ShapeDtypeStruct((x_shape.shape[0] // self.n, *x_shape.shape[1:]),
                                        x_shape.dtype)
            slots = jax.tree.leaves(chunks)[0].shape[1]
            self.split_bwd = SplitBackward(functools.partial(self.run, layers=slots),
                                           self.chunk(0), rows, self.shard_hooks)

    def loop(self, tables: Tables) -> Carry:
        """The carry after every tick of the program in `tables`."""
        d = jax.lax.axis_index("pipe")
        f_pairs, b_pairs = tables.pairs

        def tick(t, c):
            row = tables.at(t, d)
            # The W buffer is never a conditional's result, which would copy
            # it: B's taps are written here, after B (a tick without a
            # backward writes its zeros into the spare slot), and the Ws
            # after it only read it.
            keep, c = c.keep, c._replace(keep=None)
            c, y = jax.lax.cond(row.f, self.forward, self.no_forward, c, row)
            c, dx, taps = jax.lax.cond(row.b, self.backward, self.no_backward, c, row)
            if self.split_bwd is not None:
                keep = jax.tree.map(lambda buf, t: buf.at[row.b_keep].set(t), keep, taps)
                keep = self.pin_keep(keep)
                for j in range(W_PER_TICK):
                    g = jax.lax.cond(row.w[j], functools.partial(self.weight, j),
                                     lambda g, keep, row: g, c.g_stack, keep, row)
                    c = c._replace(g_stack=g)
            c = c._replace(keep=keep)
            fwd = c.fwd.at[row.fwd_arrival].set(send(y, row.f_send, f_pairs))
            bwd = c.bwd.at[row.bwd_arrival].set(send(dx, row.b_send, b_pairs))
            return c._replace(fwd=self.place(fwd), bwd=self.place(bwd))

        return jax.lax.fori_loop(0, tables.ticks, tick, self.start(tables.slots))

    def start(self, slots: tuple[int, int, int, int]) -> Carry:
        n_stash, n_fwd, n_bwd, n_keep = slots
        keep = jnp.zeros(())
        if self.split_bwd is not None:
            keep = self.pin_keep(self.split_bwd.taps((n_keep + 1, self.n)))
        # Inboxes have one spare slot, where "nothing arrived" is written.
        return Carry(fwd=self.buffer(n_fwd + 1), bwd=self.buffer(n_bwd + 1),
                     stash=self.buffer(n_stash), keep=keep,
                     g_stack=self.pin(self.zero_grads(self.chunks), self.where.stage_grads),
                     g_outer=self.pin(self.zero_grads(self.outer), self.where.outer_grads),
                     loss=jnp.zeros((self.n,), jnp.float32))

    def pin_keep(self, keep):
        """The W buffer, (slots, shards, layers, ...) per tap, its shards split
        as the batch's and each tap as its product laid it out."""
        specs = self.split_bwd.tap_specs(self.shard_hooks.rules, dict(self.mesh.shape),
                                         (None, self.where.shard_axes or None))
        return jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(
            a, NamedSharding(self.mesh, s)), keep, specs)

    # -- forward: embed (first chunk), one chunk, loss (last chunk) ---------
    def no_forward(self, c: Carry, row: Row) -> tuple[Carry, jax.Array]:
        return c, self.x_zero

    def forward(self, c: Carry, row: Row) -> tuple[Carry, jax.Array]:
        """Stashes its input; on the last chunk adds the loss and the head's
        gradients and leaves the loss gradient in the gradient inbox;
        returns the output for the next stage."""
        mb = self.microbatch(row.f_mb)
        x = jax.lax.cond(row.f_first, lambda: self.embed(mb["tokens"], self.hooks),
                         lambda: self.act(c.fwd[row.f_read]))
        y = self.act(self.run(self.chunk(row.f_chunk), x, self.hooks, row.f_layers))
        c = c._replace(stash=self.place(c.stash.at[row.f_stash].set(x)))

        def with_head(c):
            loss, g_o, dy = self.head(y, mb)
            return c._replace(loss=c.loss + loss, g_outer=self.add_outer(c.g_outer, g_o),
                              bwd=self.place(c.bwd.at[row.f_dy].set(dy))), self.x_zero

        return jax.lax.cond(row.f_last, with_head, lambda c: (c, y), c)

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
    def no_backward(self, c: Carry, row: Row) -> tuple[Carry, jax.Array, Any]:
        taps = self.split_bwd.taps((self.n,)) if self.split_bwd is not None else ()
        return c, self.x_zero, taps

    def backward(self, c: Carry, row: Row) -> tuple[Carry, jax.Array, Any]:
        """Adds the chunk's weight gradients (under a split backward, those
        of its non-matrix parameters), and on the first chunk the
        embedding's; returns the input's gradient for the previous stage,
        and under a split backward what W needs (the taps)."""
        h, chunk, k = self.shard_hooks, self.chunk(row.b_chunk), row.b_chunk
        x, dy = c.stash[row.b_stash], c.bwd[row.b_read]

        def run(w, x):
            return self.run(w, x, h, row.b_layers)

        if self.split_bwd is None:
            def chunk_vjp(chunk, x, dy):
                return jax.vjp(run, chunk, x)[1](dy)
            g_chunk, dx = self.per_shard(chunk_vjp, chunk, self.split(x), self.split(dy))
            c = c._replace(g_stack=self.add_stack(c.g_stack, k, self.cast(g_chunk)))
            taps = ()
        else:
            def input_grad(chunk, x, dy):
                return self.split_bwd.input_grad(run, chunk, x, dy)
            taps, g_others, dx = self.per_shard(input_grad, chunk, self.split(x), self.split(dy))
            g_others = self.split_bwd.of_others(self.cast(g_others))
            c = c._replace(g_stack=self.add_stack(c.g_stack, k, g_others))

        def first(c):
            g_o = self.embed_grads(row.b_mb, dx)
            return c._replace(g_outer=self.add_outer(c.g_outer, g_o)), self.x_zero

        c, dx = jax.lax.cond(row.b_first, first, lambda c: (c, self.merge(dx)), c)
        return c, dx, taps

    def embed_grads(self, mb, dx) -> Any:
        """The embedding's gradients, per shard, for microbatch `mb`, from
        dx: the gradient of the first chunk's input, split per shard."""
        def embed_vjp(outer, tokens, dx):
            return jax.vjp(lambda o: self.fns.embed(o, tokens[:, :-1], self.shard_hooks),
                           outer)[1](dx)[0]
        tokens = self.split(self.microbatch(mb)["tokens"])
        return self.cast(self.per_shard(embed_vjp, self.outer, tokens, dx))

    # -- weight gradients (split backward) ------------------------------------
    def weight(self, j: int, g_stack, keep, row: Row):
        """The j-th W of the tick: the matrices' gradients of the chunk whose
        B kept W slot `w_slot[j]`, added to the accumulator `g_stack`."""
        taps = jax.tree.map(lambda buf: buf[row.w_slot[j]], keep)
        g = self.per_shard(lambda _, taps: self.split_bwd.weight_grads(self.shard_hooks, taps),
                           None, taps)
        return self.add_stack(g_stack, row.w_chunk[j], self.split_bwd.of_matrices(self.cast(g)))

    # -- accumulators ----------------------------------------------------------
    def add_stack(self, acc, k, g):
        """acc with per-shard chunk gradients g added at local chunk k (None leaves: nothing)."""
        def add(a, g):
            return a if g is None else a.at[:, k].add(g)
        return self.pin(jax.tree.map(add, acc, g), self.where.stage_grads)

    def add_outer(self, acc, g):
        return self.pin(jax.tree.map(jnp.add, acc, g), self.where.outer_grads)
