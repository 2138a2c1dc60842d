"""Pipeline-parallel loss and gradients: one loop over a schedule's ticks in
`shard_map`, manual over `pipe` only.

`data`, `fsdp` and `tensor` stay automatic inside each stage, so ZeRO and
tensor parallelism work unchanged within a stage (full 3D). Each tick every
device looks up its action in the schedule's table (schedule.py): a forward
(F) or backward (B) of one microbatch through one of its chunks, or nothing.
Then activations move one stage on and gradients one stage back, with
`ppermute` around the `pipe` ring.

A forward keeps only its chunk's input (the stash); the backward recomputes
the chunk's forward from it (activation checkpointing at chunk granularity),
so what a device holds is the stash: m inputs under gpipe, at most p under
1f1b. Buffer slots for the stash and for messages waiting to be used are
assigned when the table is compiled (program.py), so the loop indexes fixed
arrays.

The layer stack is stored in the slots of its cut (cut.py): device d's
chunks d, d + p, ... in its own part of the slot dimension, so a device
runs what it stores. A chunk shorter than its slots (layer counts that the
stages do not divide) runs its slots one at a time and passes its input
through the padding ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zero_jax.accumulate import split_microbatches
from zero_jax.hooks import RowSplit, psum
from zero_jax.loss import cross_entropy
from zero_jax.pipeline.cut import Stages
from zero_jax.pipeline.program import BWD, FWD, Program
from zero_jax.pipeline.schedule import Schedule
from zero_jax.sharding.specs import entry_axes, map_specs, named_leaves, spec_leaves

@dataclasses.dataclass(frozen=True)
class PipelineFns:
    """A model cut for pipelining: embedding, any run of stacked layers, head."""

    split: Callable[[Any], tuple[Any, Any]]  # params -> (outer params, stacked layers)
    merge: Callable[[Any, Any], Any]  # (outer, stacked) -> params
    embed: Callable[[Any, jax.Array, Any], jax.Array]  # (outer, tokens B x T, hooks) -> x
    stage: Callable[[Any, jax.Array, Any], jax.Array]  # (stacked slice, x, hooks) -> x
    head: Callable[[Any, jax.Array, Any], jax.Array]  # (outer, x, hooks) -> logits
    # embed only reads table rows through hooks.lookup, and head's logits run
    # over the rows of a table: both can run on row blocks (hooks.RowSplit)
    vocab_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where a pipeline's parameters and gradient accumulators live."""

    stack: Any  # specs of the stacked parameters (first dimension over `pipe`)
    stage_grads: Any  # a stage's gradient accumulator: its chunks first, `pipe` left out
    outer_grads: Any  # the embedding and head gradient accumulator
    grad_dtype: Any  # gradients are accumulated in this dtype
    gather: tuple[Any, Any] | None = None  # (outer, stacked) compute specs: gather once per step
    shard_axes: tuple[str, ...] = ()  # data-parallel axes whose gradient sums stay per device
    shards: int = 1  # product of their sizes
    stages: Stages | None = None  # the stack's cut into chunks and slots
    outer: Any = None  # storage specs of the parameters outside the stack (their `pipe` split)


class Tick(NamedTuple):
    """What one device's action at one tick produces (zeros where it has none)."""

    stash: jax.Array  # F: its input, kept for its backward
    to_next: jax.Array  # F: its output, for the next stage
    to_prev: jax.Array  # B: the gradient of its input, for the previous stage
    loss_grad: jax.Array  # F of the last chunk: the loss gradient its backward starts from
    chunk_grads: Any  # B: gradients of the chunk's weights, per shard
    outer_grads: Any  # embedding (B of the first chunk) and head (F of the last) gradients, per shard
    loss: jax.Array  # F of the last chunk: the microbatch's loss, per shard


def loss_and_grads(fns: PipelineFns, hooks, schedule: Schedule, mesh: Mesh, params: Any,
                   batch: jax.Array, scale: jax.Array, where: StageLayout) -> tuple[jax.Array, Any]:
    """Mean loss (times `scale`) and gradients of `params` over `batch` (a
    `step.weighted` batch), pipelined.

    Gradients come back as sums per shard of the batch over
    `where.shard_axes`, with a leading axis of `where.shards`, for the caller
    to reduce once; with no such axes they are reduced already (a leading
    axis of one).
    """
    p, m, v = schedule.p, schedule.m, schedule.v
    prog = Program.of(schedule)
    cpu = mesh.devices.flat[0].platform == "cpu"
    outer, stack = fns.split(params)
    stack = jax.lax.with_sharding_constraint(stack, _named(mesh, where.stack))
    micro = split_microbatches(batch, m)
    table = {k: jnp.asarray(getattr(prog, k)) for k in Program.tables()}
    counts = jnp.asarray(where.stages.device_counts() if where.stages is not None
                         else np.full((p, v), jax.tree.leaves(stack)[0].shape[0] // (p * v)))
    x_shape = jax.eval_shape(lambda o, t: fns.embed(o, t[:, :-1], hooks), outer,
                             micro["tokens"][0])

    def body(outer, stack, micro, scale):
        d = jax.lax.axis_index("pipe")
        # Inside, shardings refer to the context mesh, whose `pipe` is manual.
        inner = jax.sharding.get_abstract_mesh()
        hooks_in = dataclasses.replace(hooks, mesh=inner)
        if where.gather is not None:  # ZeRO-3: gather here, before the loop, once
            # Already in the compute layout: the hooks must not re-shard them.
            hooks_in = dataclasses.replace(hooks_in, stored=None)
            outer = jax.lax.with_sharding_constraint(outer, _named(inner, where.gather[0]))
            stack = jax.lax.with_sharding_constraint(stack, _named(inner, where.gather[1]))
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), stack)
        steps = _Steps(fns, hooks_in, where, inner, outer, chunks, micro, scale, x_shape)

        def tick(t, c):
            row = {k: v[t, d] for k, v in table.items()}
            row["layers"] = counts[d, row["chunk"]]
            out = jax.lax.switch(row["kind"], [steps.nothing, steps.forward, steps.backward], c, row)
            return steps.record(c, row, out, p)

        c = jax.lax.fori_loop(0, schedule.ticks, tick, steps.start(prog.slots))
        g_stack = jax.tree.map(lambda a: a.reshape(a.shape[0], -1, *a.shape[3:]), c["g_stack"])
        g_outer = jax.tree.map(lambda g: psum(g, "pipe", cpu), c["g_outer"])
        return jax.lax.psum(c["loss"].sum(), "pipe"), g_outer, g_stack

    replicated = jax.tree.map(lambda _: PartitionSpec(), outer)
    piped = jax.tree.map(lambda _: PartitionSpec("pipe"), stack)
    per_shard_piped = jax.tree.map(lambda _: PartitionSpec(None, "pipe"), stack)
    run = jax.shard_map(body, mesh=mesh, in_specs=(replicated, piped, PartitionSpec(), PartitionSpec()),
                        out_specs=(PartitionSpec(), replicated, per_shard_piped),
                        axis_names={"pipe"}, check_vma=False)
    loss, g_outer, g_stack = run(outer, stack, micro, scale)
    return loss, fns.merge(g_outer, g_stack)


def loss(fns: PipelineFns, hooks, schedule: Schedule, mesh: Mesh, params: Any, batch: jax.Array,
         where: StageLayout) -> jax.Array:
    """Mean loss over `batch` (a `step.weighted` batch) through a forward-only schedule
    (`schedule.forward_only`): evaluation, with every stage's layers where
    they are stored. Only activations move over `pipe`; nothing is kept for
    a backward pass.

    Where the model allows it (`fns.vocab_parallel`) and its tables are
    stored in row blocks over `pipe` (zero.state_specs), nothing is gathered
    over `pipe` either. At a tick where the first stage starts a microbatch,
    every stage looks up the rows it holds and the results are summed over
    `pipe`; where the last stage finishes one, its output is summed (sent)
    to every stage, each computes the logits of its block of the vocabulary,
    and the loss combines them (loss.cross_entropy). Both are collectives
    of activations, under conditions that hold on every device alike.
    Otherwise those parameters are gathered once, at entry.
    """
    p, m, v = schedule.p, schedule.m, schedule.v
    prog = Program.of(schedule)
    outer, stack = fns.split(params)
    stack = jax.lax.with_sharding_constraint(stack, _named(mesh, where.stack))
    micro = split_microbatches(batch, m)
    table = {k: jnp.asarray(getattr(prog, k)) for k in ("kind", "mb", "chunk", "first", "last",
                                                        "read", "fwd_arrival")}
    counts = jnp.asarray(where.stages.device_counts() if where.stages is not None
                         else np.full((p, v), jax.tree.leaves(stack)[0].shape[0] // (p * v)))
    x_shape = jax.eval_shape(lambda o, t: fns.embed(o, t[:, :-1], hooks), outer,
                             micro["tokens"][0])
    outer_specs, rows = _outer_in_specs(fns, outer, where.outer, dict(mesh.shape),
                                        mesh.devices.flat[0].platform == "cpu")
    enters, leaves = (jnp.asarray(a) for a in prog.ends())

    def body(outer, stack, micro):
        d = jax.lax.axis_index("pipe")
        hooks_in = dataclasses.replace(hooks, mesh=jax.sharding.get_abstract_mesh())
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), stack)
        steps = _Steps(fns, hooks_in, where, hooks_in.mesh, outer, chunks, micro, 1.0, x_shape)
        ends = dataclasses.replace(hooks_in, rows=rows)  # the embedding's and head's hooks

        def tick(t, c):
            row = {k: a[t, d] for k, a in table.items()}
            row["layers"] = counts[d, row["chunk"]]
            if rows is None:
                out, part = jax.lax.cond(row["kind"] == FWD, lambda: steps.infer(c["fwd"], row),
                                         lambda: (steps.x_zero, jnp.zeros((), jnp.float32)))
            else:
                out, part = steps.infer_split(c["fwd"], row, enters[t], leaves[t], ends)
                part = jnp.where(d == p - 1, part, 0.0)  # every stage has it: count it once
            arrived = jax.lax.ppermute(out, "pipe", [(i, (i + 1) % p) for i in range(p)])
            return {"fwd": steps.place(c["fwd"].at[row["fwd_arrival"]].set(arrived)),
                    "loss": c["loss"] + part}

        start = {"fwd": steps.place(jnp.zeros((prog.slots[1] + 1, *x_shape.shape), x_shape.dtype)),
                 "loss": jnp.zeros((), jnp.float32)}
        c = jax.lax.fori_loop(0, schedule.ticks, tick, start)
        return jax.lax.psum(c["loss"], "pipe")

    piped = jax.tree.map(lambda _: PartitionSpec("pipe"), stack)
    run = jax.shard_map(body, mesh=mesh, in_specs=(outer_specs, piped, PartitionSpec()),
                        out_specs=PartitionSpec(), axis_names={"pipe"}, check_vma=False)
    return run(outer, stack, micro)


def tables_not_in_rows(outer: Any, stored: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(path, shape) of the tables (two or more dimensions) among the
    parameters outside the stack that are not stored in row blocks over
    `pipe` (rows that `pipe` times the axes already there does not divide)."""
    out = []
    for (path, leaf), spec in zip(named_leaves(outer).items(), spec_leaves(stored)):
        major = entry_axes(spec[0] if len(spec) else None)[:1]
        if leaf.ndim >= 2 and major != ("pipe",):
            out.append((path, tuple(leaf.shape)))
    return out


def _outer_in_specs(fns: PipelineFns, outer: Any, stored: Any, sizes: dict, widen: bool):
    """How evaluation takes the parameters outside the stack into its
    shard_map, and the RowSplit its hooks use: every table as the row blocks
    over `pipe` it is stored in, and the rest whole, if the model allows
    (`fns.vocab_parallel`) and every table is stored so; else everything
    whole (gathered at entry), and no RowSplit."""
    whole = jax.tree.map(lambda _: PartitionSpec(), outer)
    if not fns.vocab_parallel or stored is None or tables_not_in_rows(outer, stored):
        return whole, None
    specs = jax.tree.map(lambda a: PartitionSpec("pipe") if a.ndim >= 2 else PartitionSpec(), outer)
    return specs, RowSplit("pipe", sizes["pipe"], widen)


def _named(mesh, specs):
    return map_specs(lambda s: NamedSharding(mesh, s), specs)


class _Steps:
    """A device's three possible actions at a tick, and how their results are
    written into the loop's buffers.

    Activations and their gradients keep the model's layout (batch split).
    Gradients of weights are computed under `vmap` per shard of the batch
    over `where.shard_axes` (as in accumulate.py), so none is reduced over
    those axes inside the loop.
    """

    def __init__(self, fns: PipelineFns, hooks, where: StageLayout, mesh, outer, chunks, micro,
                 loss_scale, x_shape):
        self.fns, self.hooks, self.where, self.mesh = fns, hooks, where, mesh
        self.outer, self.chunks, self.micro = outer, chunks, micro
        self.loss_scale = loss_scale
        self.x_zero = jnp.zeros(x_shape.shape, x_shape.dtype)
        self.shard_hooks = hooks.per_shard(where.shard_axes)
        self.n = where.shards

    # -- layouts ----------------------------------------------------------
    def act(self, x):
        return self.hooks.act(x, ("batch", "res_seq", "embed"))

    def place(self, buf):
        return self.hooks.act(buf, (None, "batch", "res_seq", "embed"))

    def split(self, x):
        """(B, ...) -> (shards, B / shards, ...) for each array of `x`, each
        device's rows in its own entry."""
        spec = PartitionSpec(self.where.shard_axes or None)
        return jax.lax.with_sharding_constraint(
            jax.tree.map(lambda a: a.reshape(self.n, -1, *a.shape[1:]), x),
            NamedSharding(self.mesh, spec))

    def microbatch(self, i):
        return jax.tree.map(lambda a: a[i], self.micro)

    def merge(self, x):
        return self.act(x.reshape(-1, *x.shape[2:]))

    def pin(self, tree, specs):
        """A per-shard gradient tree pinned to `specs` behind its shards' axis."""
        lead = lambda s: PartitionSpec(self.where.shard_axes or None, *s)
        return jax.lax.with_sharding_constraint(tree, _named(self.mesh, map_specs(lead, specs)))

    def per_shard(self, f, weights, *rows):
        """`f(weights, *rows)` for each shard: `weights` shared, `rows` split (`split`)."""
        if not self.where.shard_axes:  # one shard: the same program without a vmap
            first = [jax.tree.map(lambda a: a[0], r) for r in rows]
            return jax.tree.map(lambda x: x[None], f(weights, *first))
        return jax.vmap(f, in_axes=(None,) + (0,) * len(rows),
                        spmd_axis_name=self.where.shard_axes)(weights, *rows)

    def run(self, chunk, x, hooks, layers):
        """The chunk's first `layers` slots on x. Where the cut has padding,
        slot by slot, each padding slot passing x through (its weights get
        a zero gradient); otherwise the model's own stack in one call."""
        stages = self.where.stages
        if stages is None or len(set(stages.counts)) == 1:
            return self.fns.stage(chunk, x, hooks)

        def slot(x, w_i):
            w, i = w_i
            y = self.fns.stage(jax.tree.map(lambda a: a[None], w), x, hooks)
            return jnp.where(i < layers, y, x), None

        return jax.lax.scan(slot, x, (chunk, jnp.arange(stages.slots)))[0]

    def zero_grads(self, tree, drop: int = 0):
        return jax.tree.map(lambda a: jnp.zeros((self.n, *a.shape[drop:]), self.where.grad_dtype),
                            tree)

    # -- the loop's carry -------------------------------------------------
    def start(self, slots: tuple[int, int, int]) -> dict:
        n_stash, n_fwd, n_bwd = slots
        zeros = lambda k: self.place(jnp.zeros((k, *self.x_zero.shape), self.x_zero.dtype))
        return {  # inboxes have one spare slot, where "nothing arrived" is written
            "fwd": zeros(n_fwd + 1), "bwd": zeros(n_bwd + 1), "stash": zeros(n_stash),
            "g_stack": self.pin(self.zero_grads(self.chunks), self.where.stage_grads),
            "g_outer": self.pin(self.zero_grads(self.outer), self.where.outer_grads),
            "loss": jnp.zeros((self.n,), jnp.float32),
        }

    def nothing(self, c, row) -> Tick:
        x = self.x_zero
        return Tick(x, x, x, x, self.zero_grads(self.chunks, drop=1), self.zero_grads(self.outer),
                    jnp.zeros((self.n,), jnp.float32))

    # -- forward: embed (first chunk), one chunk, loss (last chunk) ---------
    def forward(self, c, row) -> Tick:
        fns, h = self.fns, self.hooks
        mb = self.microbatch(row["mb"])
        x = jax.lax.cond(row["first"],
                         lambda: self.act(fns.embed(self.outer, mb["tokens"][:, :-1], h)),
                         lambda: self.act(c["fwd"][row["read"]]))
        chunk = jax.tree.map(lambda a: a[row["chunk"]], self.chunks)
        y = self.act(self.run(chunk, x, h, row["layers"]))

        def head_loss(outer, y, mb):
            # Each shard's weighted sum (step.weighted): the shards' and
            # microbatches' sum is the batch's mean.
            logits = fns.head(outer, y, self.shard_hooks)
            return cross_entropy(logits, mb["tokens"][:, 1:], mb["weights"]) * self.loss_scale

        def ends():
            loss, (g_o, dy) = self.per_shard(
                jax.value_and_grad(head_loss, argnums=(0, 1)), self.outer, self.split(y),
                self.split(mb))
            return loss, self._cast(g_o), self.merge(dy)

        nothing = lambda: (jnp.zeros((self.n,), jnp.float32), self.zero_grads(self.outer), self.x_zero)
        loss, g_o, dy = jax.lax.cond(row["last"], ends, nothing)
        return Tick(stash=x, to_next=jnp.where(row["last"], self.x_zero, y), to_prev=self.x_zero,
                    loss_grad=dy, chunk_grads=self.zero_grads(self.chunks, drop=1),
                    outer_grads=g_o, loss=loss)

    # -- evaluation: a forward and, on the last chunk, the loss -------------
    def infer(self, inbox, row) -> tuple[jax.Array, jax.Array]:
        """(output for the next stage, the microbatch's loss on the last chunk)."""
        fns, h = self.fns, self.hooks
        mb = self.microbatch(row["mb"])
        x = jax.lax.cond(row["first"],
                         lambda: self.act(fns.embed(self.outer, mb["tokens"][:, :-1], h)),
                         lambda: self.act(inbox[row["read"]]))
        chunk = jax.tree.map(lambda a: a[row["chunk"]], self.chunks)
        y = self.act(self.run(chunk, x, h, row["layers"]))
        part = jax.lax.cond(row["last"],
                            lambda: cross_entropy(fns.head(self.outer, y, h), mb["tokens"][:, 1:],
                                                  mb["weights"]),
                            lambda: jnp.zeros((), jnp.float32))
        return jnp.where(row["last"], self.x_zero, y), part

    def infer_split(self, inbox, row, enters, leaves, ends) -> tuple[jax.Array, jax.Array]:
        """`infer` with the tables in row blocks over `pipe` (`ends`: the
        embedding's and head's hooks, with `rows`):
        microbatch `enters` (if not -1) is looked up by every stage for the
        first, and the output of microbatch `leaves` (if not -1) sent from
        the last to every stage for the loss. Those two conditions are the
        tick's, the same on every device, as collectives over `pipe` need."""
        fns, h = self.fns, self.hooks
        x0 = jax.lax.cond(enters >= 0,
                          lambda: self.act(fns.embed(self.outer,
                                                     self.microbatch(enters)["tokens"][:, :-1],
                                                     ends)),
                          lambda: self.x_zero)
        x = jnp.where(row["first"], x0, inbox[row["read"]])
        chunk = jax.tree.map(lambda a: a[row["chunk"]], self.chunks)
        y = jax.lax.cond(row["kind"] == FWD,
                         lambda: self.act(self.run(chunk, x, h, row["layers"])),
                         lambda: self.x_zero)

        def head_loss():
            out = self.act(ends.rows.sum(jnp.where(row["last"], y, self.x_zero)))
            mb = self.microbatch(leaves)
            return cross_entropy(fns.head(self.outer, out, ends), mb["tokens"][:, 1:],
                                 mb["weights"], ends.rows.axis)

        part = jax.lax.cond(leaves >= 0, head_loss, lambda: jnp.zeros((), jnp.float32))
        return jnp.where(row["last"], self.x_zero, y), part

    # -- backward: one chunk, then the embedding (first chunk) --------------
    def backward(self, c, row) -> Tick:
        fns, h = self.fns, self.shard_hooks
        chunk = jax.tree.map(lambda a: a[row["chunk"]], self.chunks)
        x, dy = c["stash"][row["stash"]], c["bwd"][row["read"]]

        def chunk_vjp(chunk, x, dy):
            return jax.vjp(lambda w, x: self.run(w, x, h, row["layers"]), chunk, x)[1](dy)

        g_chunk, dx = self.per_shard(chunk_vjp, chunk, self.split(x), self.split(dy))

        def starts():
            def embed_vjp(outer, tokens, dx):
                return jax.vjp(lambda o: fns.embed(o, tokens[:, :-1], h), outer)[1](dx)[0]
            return self._cast(self.per_shard(embed_vjp, self.outer,
                                             self.split(self.microbatch(row["mb"])["tokens"]), dx))

        g_o = jax.lax.cond(row["first"], starts, lambda: self.zero_grads(self.outer))
        dx = self.merge(dx)
        return Tick(stash=self.x_zero, to_next=self.x_zero,
                    to_prev=jnp.where(row["first"], self.x_zero, dx), loss_grad=self.x_zero,
                    chunk_grads=self._cast(g_chunk), outer_grads=g_o,
                    loss=jnp.zeros((self.n,), jnp.float32))

    def _cast(self, grads):
        return jax.tree.map(lambda g: g.astype(self.where.grad_dtype), grads)

    # -- the buffers a tick writes ------------------------------------------
    def record(self, c, row, out: Tick, p: int) -> dict:
        """Buffers after the tick: stash, loss gradient and weight gradients
        written in place (only where this tick's action made them), then
        activations sent one stage on and gradients one stage back."""
        is_f, is_b = row["kind"] == FWD, row["kind"] == BWD
        stash = c["stash"].at[row["stash"]].set(jnp.where(is_f, out.stash, c["stash"][row["stash"]]))
        bwd_box = c["bwd"].at[row["dy"]].set(
            jnp.where(is_f & row["last"], out.loss_grad, c["bwd"][row["dy"]]))
        g_stack = jax.tree.map(
            lambda a, g: a.at[:, row["chunk"]].add(jnp.where(is_b, g, jnp.zeros_like(g))),
            c["g_stack"], out.chunk_grads)
        to_next = jax.lax.ppermute(out.to_next, "pipe", [(i, (i + 1) % p) for i in range(p)])
        to_prev = jax.lax.ppermute(out.to_prev, "pipe", [(i, (i - 1) % p) for i in range(p)])
        return {
            "stash": self.place(stash),
            "fwd": self.place(c["fwd"].at[row["fwd_arrival"]].set(to_next)),
            "bwd": self.place(bwd_box.at[row["bwd_arrival"]].set(to_prev)),
            "g_stack": self.pin(g_stack, self.where.stage_grads),
            "g_outer": self.pin(jax.tree.map(jnp.add, c["g_outer"], out.outer_grads),
                                self.where.outer_grads),
            "loss": c["loss"] + out.loss,
        }
