"""What a device does at one tick of the training loop, written into the
loop's carry.

A tick is fused (schedule.py): a device runs its forward (F) if it has one,
then its backward (B), then its weight gradients (W, under a split
backward), each under `lax.cond` on its program row (program.py), so a part
the device does not have costs nothing: it computes nothing and adds
nothing to the accumulators. Each part writes its results into the carry
itself and returns the message it sends (zeros if none). Then the sends:
one activation forward and one gradient back over every route the
schedule uses (`send`), at every tick and outside the conditionals, so
every device runs them alike (program.py says why).

A forward keeps only its chunk's input (the stash); the backward recomputes
the chunk's forward from it (activation checkpointing at chunk
granularity). A split backward keeps, for its W, each matrix product's
input and output gradient (weight_grad.py); a B whose W is in its own
tick runs as one backward with it and keeps nothing, and the loop runs
each run of ticks where no device keeps or reads a W's inputs without the
W buffer (`Tables.runs`).

With the embedding and head tables in row blocks over `pipe` (`rows`,
executor.py), every stage takes part in their work, as in evaluation
(eval_stage.py): at a tick where a microbatch enters, every stage looks up
the rows it holds; where one leaves, the last stage's output is summed
(sent) to every stage, each computes the logits of its block of the
vocabulary and their gradient, and the output's gradient is summed back;
where one's backward ends, the first stage's input gradient reaches every
stage through the lookup's transpose, and each adds its rows' gradient.
Those conditions are the tick's (`Program.ends`), the same on every device,
as collectives over `pipe` need. So each stage's table gradients are its
block's: nothing of a table is gathered or accumulated whole.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from zero_jax.model import fp8
from zero_jax.model.hooks import RowSplit
from zero_jax.model.loss import cross_entropy
from zero_jax.pipeline.program import Row, Tables
from zero_jax.model.contract import PipelineFns
from zero_jax.pipeline.records import StagePlan
from zero_jax.pipeline.schedule import W_PER_TICK
from zero_jax.pipeline.stage import Held, LocalStage, send
from zero_jax.pipeline.weight_grad import SplitBackward


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
    router: Any  # a mixture of experts: its router metrics' sums ({} for a dense model)
    stash: jax.Array  # F's inputs, kept for their B


class TrainStage(LocalStage):
    """A device's stage in the training loop: `loss_scale` multiplies the
    loss its gradients are taken of; with `split`, backwards give the input
    gradient and Ws the matrices' gradients; with `rows`, the embedding and
    head tables are this device's row blocks of them."""

    def __init__(self, fns: PipelineFns, hooks, where: StagePlan, held: Held,
                 x_shape: jax.ShapeDtypeStruct, loss_scale: jax.Array, split: bool = False,
                 rows: RowSplit | None = None):
        super().__init__(fns, hooks, where, held, x_shape)
        self.loss_scale = loss_scale
        self.rows = rows
        self.ends = dataclasses.replace(hooks, rows=rows)  # the embedding's and head's hooks
        self.shard_ends = dataclasses.replace(self.shard_hooks, rows=rows)
        self.split_bwd = None
        if split:
            rows = jax.ShapeDtypeStruct((x_shape.shape[0] // self.n, *x_shape.shape[1:]),
                                        x_shape.dtype)
            slots = jax.tree.leaves(held.chunks)[0].shape[1]
            self.split_bwd = SplitBackward(functools.partial(self.run, layers=slots),
                                           self.chunk(0), rows, self.shard_hooks)

    def loop(self, tables: Tables, ends: tuple[jax.Array, jax.Array, jax.Array]) -> Carry:
        """The carry after every tick of the program in `tables`; `ends`:
        per tick the microbatches that enter, leave and return
        (`Program.ends`), used with `rows`."""
        d = jax.lax.axis_index("pipe")
        f_routes, b_routes = tables.routes
        enters, leaves, returns = ends

        def tick(t, c, kept: bool):
            row = tables.at(t, d)
            # The W buffer is never a conditional's result, which would copy
            # it: the Ws only read it, and B's taps are written here, after
            # them (a device whose B keeps nothing writes zeros into a free
            # slot).
            keep, c = c.keep, c._replace(keep=None)
            if self.rows is None:
                c, y = jax.lax.cond(row.f, self.forward, self.no_forward, c, row)
            else:
                c, y = self.forward_split(c, row, enters[t], leaves[t])
            if kept:
                c, dx, taps = jax.lax.cond(row.b, self.backward_keeping, self.no_backward_keeping,
                                           c, row)
            else:
                c, dx = jax.lax.cond(row.b, self.backward, self.no_backward, c, row)
            if self.rows is not None:
                c, dx = self.embed_back_split(c, dx, row, returns[t])
            if kept:  # the Ws read their slots, then B's taps are written
                for j in range(W_PER_TICK):
                    g = jax.lax.cond(row.w[j], functools.partial(self.weight, j),
                                     lambda g, keep, row: g, c.g_stack, keep, row)
                    c = c._replace(g_stack=g)
                keep = jax.tree.map(lambda buf, t: buf.at[row.b_keep].set(t), keep, taps)
                keep = self.pin_keep(keep)
            c = c._replace(keep=keep)
            fwd = c.fwd.at[row.fwd_arrival].set(send(y, f_routes))
            bwd = c.bwd.at[row.bwd_arrival].set(send(dx, b_routes))
            return c._replace(fwd=self.place(fwd), bwd=self.place(bwd))

        # A loop per run of ticks alike: where no device keeps taps for a
        # later W or runs one (a split backward's steady state, where each
        # B runs with its own W), the tick moves nothing of the W buffer.
        c = self.start(tables.slots)
        for start, stop, kept in tables.runs():
            kept = kept and self.split_bwd is not None
            c = jax.lax.fori_loop(start, stop, functools.partial(tick, kept=kept), c)
        return c

    def start(self, slots: tuple[int, int, int, int]) -> Carry:
        n_stash, n_fwd, n_bwd, n_keep = slots
        keep = jnp.zeros(())
        if self.split_bwd is not None:
            keep = self.pin_keep(self.split_bwd.taps((n_keep, self.n)))
        # Inboxes have one spare slot, where "nothing arrived" is written.
        return Carry(fwd=self.buffer(n_fwd + 1), bwd=self.buffer(n_bwd + 1),
                     stash=self.buffer(n_stash), keep=keep,
                     g_stack=self.pin(self.zero_grads(self.chunks), self.where.stage_grads),
                     g_outer=self.pin(self.zero_grads(self.outer), self.where.outer_grads),
                     loss=jnp.zeros((self.n,), jnp.float32), router=self.no_router())

    # -- a mixture of experts' router losses ------------------------------------
    def no_router(self) -> dict:
        """Zero router metrics: aux_loss and z_loss, and expert_load per
        local chunk and slot (v, slots, experts)."""
        if self.fns.penalty is None:
            return {}
        slots = jax.tree.leaves(self.chunks)[0].shape[1]
        rows = jax.ShapeDtypeStruct(self.x_zero.shape[:1], jnp.float32)
        _, m = jax.eval_shape(lambda c, x, w: self.fns.penalty(
            self.run(c, x, self.hooks, slots)[1], w), self.chunk(0), self.x_zero, rows)
        v = jax.tree.leaves(self.chunks)[0].shape[0]
        return {k: jnp.zeros((v, *a.shape) if k == "expert_load" else a.shape, a.dtype)
                for k, a in m.items()}

    def add_router(self, acc: dict, k, stats, mb) -> dict:
        """acc plus the router metrics of a forward of local chunk k on microbatch mb."""
        if self.fns.penalty is None:
            return acc
        _, m = self.fns.penalty(stats, self.row_weights(mb))
        return {"aux_loss": acc["aux_loss"] + m["aux_loss"], "z_loss": acc["z_loss"] + m["z_loss"],
                "expert_load": acc["expert_load"].at[k].add(m["expert_load"])}

    def with_penalty(self, chunk, x, hooks, layers, row_weights):
        """The chunk on x: (its output, its part of the router losses' term,
        times the loss scale, float32), what a mixture of experts' backward
        differentiates, the term seeded with one."""
        y, stats = self.run(chunk, x, hooks, layers)
        term, _ = self.fns.penalty(stats, row_weights)
        return y, (term * self.loss_scale).astype(jnp.float32)

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

    def forward(self, c: Carry, row: Row, x0: jax.Array | None = None) -> tuple[Carry, jax.Array]:
        """Stashes its input; on the last chunk adds the loss and the head's
        gradients and leaves the loss gradient in the gradient inbox;
        returns the output for the next stage. Given `x0` (the first
        chunk's input, looked up by every stage), it returns the chunk's
        output on the last chunk too, for `head_split`."""
        mb = self.microbatch(row.f_mb)
        if x0 is None:
            x = jax.lax.cond(row.f_first, lambda: self.embed(mb["inputs"], self.hooks),
                             lambda: self.act(c.fwd[row.f_read]))
        else:
            x = jnp.where(row.f_first, x0, self.act(c.fwd[row.f_read]))
        y, stats = self.run(self.chunk(row.f_chunk), x, self.hooks, row.f_layers)
        y = self.act(y)
        c = c._replace(stash=self.place(c.stash.at[row.f_stash].set(x)),
                       router=self.add_router(c.router, row.f_chunk, stats, row.f_mb))
        if x0 is not None:
            return c, y

        def with_head(c):
            loss, g_o, dy = self.head(y, mb)
            return c._replace(loss=c.loss + loss, g_outer=self.add_outer(c.g_outer, g_o),
                              bwd=self.place(c.bwd.at[row.f_dy].set(dy))), self.x_zero

        return jax.lax.cond(row.f_last, with_head, lambda c: (c, y), c)

    def head(self, y, mb) -> tuple[jax.Array, Any, jax.Array]:
        """The last chunk's end: per shard, the loss of output y, the head's
        gradients, and the loss gradient the backward starts from."""
        def head_loss(outer, y, mb):
            # Each shard's weighted sum (grads.weighted): the shards' and
            # microbatches' sum is the batch's mean.
            logits = self.fns.head(outer, y, self.shard_hooks)
            return cross_entropy(logits, mb["targets"], mb["weights"]) * self.loss_scale

        loss, (g_o, dy) = self.per_shard(
            jax.value_and_grad(head_loss, argnums=(0, 1)), self.outer, self.split(y),
            self.split(mb))
        return loss, self.cast(g_o), self.merge(dy)

    def forward_split(self, c: Carry, row: Row, enters, leaves) -> tuple[Carry, jax.Array]:
        """`forward` with the tables in row blocks over `pipe`: microbatch
        `enters` (if not -1) is looked up by every stage for the first
        chunk, and the loss of microbatch `leaves` (if not -1) is taken by
        every stage (`head_split`)."""
        x0 = jax.lax.cond(enters >= 0,
                          lambda: self.embed(self.microbatch(enters)["inputs"], self.ends),
                          lambda: self.x_zero)
        c, y = jax.lax.cond(row.f, self.forward, lambda c, row, x0: (c, self.x_zero), c, row, x0)
        c = jax.lax.cond(leaves >= 0, functools.partial(self.head_split, leaves),
                         lambda c, y, row: c, c, y, row)
        return c, jnp.where(row.f_last, self.x_zero, y)

    def head_split(self, leaves, c: Carry, y, row: Row) -> Carry:
        """The loss of microbatch `leaves`, whose last chunk's output y is on
        the last stage: every stage computes the logits of its block of the
        vocabulary and adds its block's gradients; the last stage adds the
        loss and gets the loss gradient in its gradient inbox."""
        mb = self.microbatch(leaves)
        last = jax.lax.axis_index("pipe") == self.rows.size - 1

        def head_loss(outer, y, mb):
            out = self.rows.sum(jnp.where(row.f_last, y, jnp.zeros((), y.dtype)))
            logits = self.fns.head(outer, out, self.shard_ends)
            return cross_entropy(logits, mb["targets"], mb["weights"],
                                 self.rows.axis) * self.loss_scale

        def loss_and_grads(outer, y, mb):
            loss, pull = jax.vjp(lambda o, y: head_loss(o, y, mb), outer, y)
            # Every stage holds the loss; seeded on the last stage only, the
            # transpose of each sum over `pipe` (a sum: the shard_map tracks
            # no replication) takes the seed to every stage's block of
            # logits, and the output's gradient, summed, back to the last.
            g_o, dy = pull(jnp.where(last, 1.0, 0.0).astype(loss.dtype))
            return jnp.where(last, loss, 0.0), g_o, dy

        loss, g_o, dy = self.per_shard(loss_and_grads, self.outer, self.split(y), self.split(mb))
        dy = self.merge(dy)
        bwd = c.bwd.at[row.f_dy].set(jnp.where(row.f_last, dy, c.bwd[row.f_dy]))
        return c._replace(loss=c.loss + loss, g_outer=self.add_outer(c.g_outer, self.cast(g_o)),
                          bwd=self.place(bwd))

    # -- backward: one chunk, then the embedding (first chunk) --------------
    def no_backward(self, c: Carry, row: Row) -> tuple[Carry, jax.Array]:
        return c, self.x_zero

    def no_backward_keeping(self, c: Carry, row: Row) -> tuple[Carry, jax.Array, Any]:
        return c, self.x_zero, self.split_bwd.taps((self.n,))

    def backward(self, c: Carry, row: Row) -> tuple[Carry, jax.Array]:
        """Adds the chunk's weight gradients, and on the first chunk the
        embedding's; returns the input's gradient for the previous stage.
        Under a split backward, a B whose W is in its tick runs so."""
        def chunk_vjp(run, chunk, x, dy):
            return jax.vjp(run, chunk, x)[1](dy)
        g_chunk, dx = self.chunk_backward(chunk_vjp, c, row)
        c = c._replace(g_stack=self.add_stack(c.g_stack, row.b_chunk, self.cast(g_chunk)))
        return self.backward_end(c, dx, row)

    def backward_keeping(self, c: Carry, row: Row) -> tuple[Carry, jax.Array, Any]:
        """A B of a split backward, returning also what its W needs (the
        taps). One whose W runs later adds the gradients of the chunk's
        non-matrix parameters only; one whose W is in its tick runs as
        `backward` (its taps zeros)."""
        def whole(c):
            return *self.backward(c, row), self.split_bwd.taps((self.n,))

        def input_only(c):
            def input_grad(run, chunk, x, dy):
                return self.split_bwd.input_grad(run, chunk, x, dy)
            taps, g_others, dx = self.chunk_backward(input_grad, c, row)
            g_others = self.split_bwd.of_others(self.cast(g_others))
            c = c._replace(g_stack=self.add_stack(c.g_stack, row.b_chunk, g_others))
            return *self.backward_end(c, dx, row), taps

        return jax.lax.cond(row.b_whole, whole, input_only, c)

    def chunk_backward(self, f, c: Carry, row: Row):
        """f(run, chunk, x, dy) per shard, for the backward's chunk, its
        stashed input x and its output's gradient dy. A mixture of experts'
        `run` returns its router losses' term too (`with_penalty`), and dy
        is (dy, 1): the term is part of the loss."""
        h, chunk = self.shard_hooks, self.chunk(row.b_chunk)
        x, dy = c.stash[row.b_stash], c.bwd[row.b_read]
        if self.fns.penalty is None:
            def run(w, x):
                return self.run(w, x, h, row.b_layers)[0]
            return self.per_shard(functools.partial(f, run), chunk, self.split(x), self.split(dy))

        def with_router(chunk, x, dy, row_weights):
            def run(w, x):
                return self.with_penalty(w, x, h, row.b_layers, row_weights)
            return f(run, chunk, x, (dy, jnp.ones((), jnp.float32)))
        return self.per_shard(with_router, chunk, self.split(x), self.split(dy),
                              self.split(self.row_weights(row.b_mb)))

    def backward_end(self, c: Carry, dx, row: Row) -> tuple[Carry, jax.Array]:
        """On the first chunk, the embedding's gradients from dx (per
        shard); returns the gradient sent to the previous stage."""
        def first(c):
            g_o = self.embed_grads(row.b_mb, dx, self.shard_hooks)
            return c._replace(g_outer=self.add_outer(c.g_outer, g_o)), self.x_zero

        if self.rows is not None:  # embed_back_split, on every stage
            return c, self.merge(dx)
        return jax.lax.cond(row.b_first, first, lambda c: (c, self.merge(dx)), c)

    def embed_back_split(self, c: Carry, dx, row: Row, returns) -> tuple[Carry, jax.Array]:
        """With the tables in row blocks: where microbatch `returns` (if not
        -1) ends its backward, on the first stage with input gradient dx,
        every stage adds its rows' gradients (the lookup's sum over `pipe`
        transposes to a sum, which takes dx from the first stage to all).
        Returns what the backward sends: dx except on the first chunk."""
        def grads(c):
            cotangent = self.split(jnp.where(row.b_first, dx, jnp.zeros((), dx.dtype)))
            g_o = self.embed_grads(returns, cotangent, self.shard_ends)
            return c._replace(g_outer=self.add_outer(c.g_outer, g_o))

        c = jax.lax.cond(returns >= 0, grads, lambda c: c, c)
        return c, jnp.where(row.b_first, self.x_zero, dx)

    def embed_grads(self, mb, dx, hooks) -> Any:
        """The embedding's gradients, per shard, for microbatch `mb`, from
        dx: the gradient of the first chunk's input, split per shard."""
        def embed_vjp(outer, tokens, dx):
            return jax.vjp(lambda o: self.fns.embed(o, tokens, hooks), outer)[1](dx)[0]
        tokens = self.split(self.microbatch(mb)["inputs"])
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
        def add(path, a, g):  # an amax history's reports combine by max (fp8.py)
            if g is None:
                return a
            return a.at[:, k].max(g) if fp8.is_history(path) else a.at[:, k].add(g)
        return self.pin(jax.tree_util.tree_map_with_path(add, acc, g), self.where.stage_grads)

    def add_outer(self, acc, g):
        return self.pin(fp8.combine(acc, g), self.where.outer_grads)
