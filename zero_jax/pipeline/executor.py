"""Pipeline-parallel loss and gradients, and evaluation: one loop over a
schedule's ticks in `shard_map`, manual over `pipe` only.

`data`, `fsdp` and `tensor` stay automatic inside each stage, so ZeRO and
tensor parallelism work unchanged within a stage (full 3D). Each tick every
device looks up its part of the schedule's table (schedule.py): at most one
forward (F) and one backward (B) of a microbatch through its chunks, and
under zb-h1 weight gradients (W). Then activations move one stage on and
gradients one stage back, with `ppermute` between the stages that send.

A forward keeps only its chunk's input (the stash); the backward recomputes
the chunk's forward from it, so what a device holds is the stash: m inputs
under gpipe, 2 (p - d) - 1 on stage d under 1f1b.

The layer stack is stored in the slots of its cut (cut.py): device d's
chunks d, d + p, ... in its own part of the slot dimension, so a device
runs what it stores. A chunk shorter than its slots (layer counts that the
stages do not divide) runs its slots one at a time and passes its input
through the padding ones.

The parts, each in its own module: the schedule compiled into the index
tables the loop reads, with the stash's, inboxes' and W buffer's slots
(program.py);
what a device holds and the pieces its actions are built from (stage.py);
a tick's actions and how their results are written into the loop's carry,
for training (train_stage.py, with weight_grad.py for a split backward)
and evaluation (eval_stage.py); what the loop needs from the model
(`PipelineFns`) and the state's plan (`StagePlan`, records.py). Here: the
`shard_map` around the loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from zero_jax.data.microbatches import split_microbatches
from zero_jax.context import order as context_order
from zero_jax.model.hooks import RowSplit
from zero_jax.model.param_use import psum
from zero_jax.pipeline.eval_stage import EvalStage
from zero_jax.pipeline.program import Program, Tables
from zero_jax.model.contract import PipelineFns
from zero_jax.pipeline.records import StagePlan
from zero_jax.pipeline.schedule import Schedule
from zero_jax.pipeline.stage import Held, chunks_of, constrain
from zero_jax.pipeline.train_stage import TrainStage
from zero_jax.sharding.specs import entry_axes, map_specs, named_leaves, spec_leaves


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What a loop takes into `shard_map` besides its traced inputs: fixed
    before tracing, the same on every device."""

    fns: PipelineFns
    hooks: Any  # the step's hooks (outside the shard_map: mesh and all)
    where: StagePlan
    schedule: Schedule
    program: Program
    tables: Tables  # the program's tables, as device arrays
    x_shape: jax.ShapeDtypeStruct  # a stage's input, one microbatch
    outer_specs: Any  # how the parameters outside the stack enter: row blocks over pipe, or whole
    rows: RowSplit | None  # the tables the loop uses in their row blocks (`_outer_in_specs`)
    widen: bool  # sums over `pipe` of 16-bit gradients run in float32 (CPU: param_use.psum)


def _prepare(fns: PipelineFns, hooks, schedule: Schedule, mesh: Mesh, params: Any,
             batch: jax.Array, where: StagePlan):
    """(the loop, the parameters outside the stack, the stack in its stored
    layout, the microbatches)."""
    program = Program.of(schedule)
    outer, stack = fns.split(params)
    stack = constrain(stack, mesh, where.stack)
    # Inputs, targets and weights (B x T each), laid out over `context`.
    order = hooks.sequence_order(batch["tokens"].shape[1] - 1)
    micro = split_microbatches(context_order.shifted(batch, order), schedule.m)
    tables = Tables(program, _layer_counts(where, stack, schedule.p, schedule.v))
    x_shape = jax.eval_shape(lambda o, t: fns.embed(o, t, hooks), outer, micro["inputs"][0])
    cpu = mesh.devices.flat[0].platform == "cpu"
    outer_specs, rows = _outer_in_specs(fns, outer, where, dict(mesh.shape), cpu)
    loop = _Loop(fns, hooks, where, schedule, program, tables, x_shape, outer_specs, rows, cpu)
    return loop, outer, stack, micro


def _layer_counts(where: StagePlan, stack: Any, p: int, v: int) -> np.ndarray:
    """Layers in each (device, local chunk): the cut's, else the stack split evenly."""
    if where.stages is not None:
        return where.stages.device_counts()
    return np.full((p, v), jax.tree.leaves(stack)[0].shape[0] // (p * v))


def loss_and_grads(fns: PipelineFns, hooks, schedule: Schedule, mesh: Mesh, params: Any,
                   batch: jax.Array, scale: jax.Array,
                   where: StagePlan) -> tuple[jax.Array, dict, Any]:
    """Mean loss (times `scale`), router metrics and gradients of `params`
    over `batch` (a `grads.weighted` batch), pipelined.

    The router metrics are a mixture of experts' (`fns.penalty`; {} for a
    dense model): aux_loss and z_loss, and expert_load per stored slot of
    the stack (its padding slots zeros), for the caller to put in layer
    order.

    Gradients come back as sums per shard of the batch over
    `where.shard_axes`, with a leading axis of `where.shards`, for the caller
    to reduce once; with no such axes they are reduced already (a leading
    axis of one). The tables that `row_tables` finds are used, and their
    gradients accumulated and returned, in the row blocks over `pipe` they
    are stored in (train_stage.py); the other parameters outside the stack
    are taken whole and their gradients summed over `pipe`.
    """
    loop, outer, stack, micro = _prepare(fns, hooks, schedule, mesh, params, batch, where)
    ends = tuple(jnp.asarray(a) for a in loop.program.ends())
    piped = jax.tree.map(lambda _: PartitionSpec("pipe"), stack)
    per_shard_piped = jax.tree.map(lambda _: PartitionSpec(None, "pipe"), stack)
    per_shard_outer = map_specs(lambda s: PartitionSpec(None, *s), loop.outer_specs)
    router = {} if fns.penalty is None else {"aux_loss": PartitionSpec(),
                                             "z_loss": PartitionSpec(),
                                             "expert_load": PartitionSpec("pipe")}
    run = jax.shard_map(functools.partial(_train, loop, ends), mesh=mesh,
                        in_specs=(loop.outer_specs, piped, PartitionSpec(), PartitionSpec()),
                        out_specs=(PartitionSpec(), router, per_shard_outer, per_shard_piped),
                        axis_names={"pipe"}, check_vma=False)
    loss, router, g_outer, g_stack = run(outer, stack, micro, scale)
    return loss, router, fns.merge(g_outer, g_stack)


def _train(loop: _Loop, ends, outer, stack, micro, scale):
    """One device's training loop, inside `shard_map`: the loss summed over
    `pipe`, the embedding's and head's gradients (the row block of each
    table taken in blocks, `loop.outer_specs`; the rest summed over `pipe`,
    bf16 in float32 on CPU, param_use.psum) and its stage's gradients; the
    router metrics, summed over `pipe` but expert_load, the device's slots'."""
    # Inside, shardings refer to the context mesh, whose `pipe` is manual.
    inner = jax.sharding.get_abstract_mesh()
    hooks = dataclasses.replace(loop.hooks, mesh=inner)
    where = loop.where
    if where.gather is not None:  # ZeRO-3: gather here, before the loop, once
        # Already in the compute layout: the hooks must not re-shard them.
        hooks = dataclasses.replace(hooks, stored=None)
        outer = constrain(outer, inner, where.gather[0])
        stack = constrain(stack, inner, where.gather[1])
    held = Held(outer, chunks_of(stack, loop.schedule.v), micro)
    stage = TrainStage(loop.fns, hooks, where, held, loop.x_shape, scale,
                       split=loop.schedule.split_backward, rows=loop.rows)
    c = stage.loop(loop.tables, ends)
    # (shards, v, slots, ...) -> (shards, v * slots, ...): the device's part of the stack
    g_stack = jax.tree.map(lambda a: a.reshape(a.shape[0], -1, *a.shape[3:]), c.g_stack)
    g_outer = jax.tree.map(
        lambda g, s: g if s == PartitionSpec("pipe") else psum(g, "pipe", loop.widen),
        c.g_outer, spec_leaves_like(c.g_outer, loop.outer_specs))
    router = {k: a.reshape(-1, *a.shape[2:]) if k == "expert_load" else jax.lax.psum(a, "pipe")
              for k, a in c.router.items()}
    return jax.lax.psum(c.loss.sum(), "pipe"), router, g_outer, g_stack


def loss(fns: PipelineFns, hooks, schedule: Schedule, mesh: Mesh, params: Any, batch: jax.Array,
         where: StagePlan) -> jax.Array:
    """Mean loss over `batch` (a `grads.weighted` batch) through a forward-only schedule
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
    loop, outer, stack, micro = _prepare(fns, hooks, schedule, mesh, params, batch, where)
    enters, leaves, _ = (jnp.asarray(a) for a in loop.program.ends())
    piped = jax.tree.map(lambda _: PartitionSpec("pipe"), stack)
    run = jax.shard_map(functools.partial(_evaluate, loop, enters, leaves), mesh=mesh,
                        in_specs=(loop.outer_specs, piped, PartitionSpec()),
                        out_specs=PartitionSpec(), axis_names={"pipe"}, check_vma=False)
    return run(outer, stack, micro)


def _evaluate(loop: _Loop, enters, leaves, outer, stack, micro):
    """One device's evaluation loop, inside `shard_map`: the loss summed over `pipe`."""
    hooks = dataclasses.replace(loop.hooks, mesh=jax.sharding.get_abstract_mesh())
    stage = EvalStage(loop.fns, hooks, loop.where,
                      Held(outer, chunks_of(stack, loop.schedule.v), micro), loop.x_shape,
                      loop.rows)
    c = stage.loop(loop.tables, enters, leaves)
    return jax.lax.psum(c.loss, "pipe")


def tables_not_in_rows(outer: Any, stored: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(path, shape) of the tables (two or more dimensions) among the
    parameters outside the stack that are not stored in row blocks over
    `pipe` (rows that `pipe` times the axes already there does not divide)."""
    return [(path, tuple(leaf.shape)) for (path, leaf), rows
            in zip(named_leaves(outer).items(), jax.tree.leaves(_in_rows(outer, stored)))
            if _is_table(leaf) and not rows]


def _in_rows(outer: Any, stored: Any) -> Any:
    """Per parameter outside the stack: a table stored in row blocks over `pipe`."""
    def rows(leaf, spec):
        return _is_table(leaf) and entry_axes(spec[0] if len(spec) else None)[:1] == ("pipe",)
    return jax.tree.map(rows, outer, spec_leaves_like(outer, stored))


def spec_leaves_like(tree: Any, specs: Any) -> Any:
    """The spec tree `specs` with the structure of `tree` (a spec per leaf)."""
    return jax.tree.unflatten(jax.tree.structure(tree), spec_leaves(specs))


def row_tables(fns: PipelineFns, outer: Any, stored: Any, names: Any) -> Any:
    """Per parameter outside the stack, whether the loops use it in the row
    blocks over `pipe` it is stored in: the tables so stored, if the model
    allows (`fns.vocab_parallel`) and the vocabulary's tables (logical rows
    "vocab", the first axis in `names`) are among them; else none."""
    none = jax.tree.map(lambda _: False, outer)
    if not fns.vocab_parallel or stored is None or names is None:
        return none
    in_rows = _in_rows(outer, stored)
    rows_of = [n[0] if len(n) else None for n in spec_leaves(names)]
    if not all(r for r, n in zip(jax.tree.leaves(in_rows), rows_of) if n == "vocab"):
        return none
    return in_rows


def split_tables(fns: PipelineFns, outer: Any, stored: Any, names: Any) -> tuple[str, ...]:
    """The logical row names of the tables `row_tables` finds."""
    rows = jax.tree.leaves(row_tables(fns, outer, stored, names))
    return tuple(sorted({n[0] for r, n in zip(rows, spec_leaves(names)) if r}))


def _outer_in_specs(fns: PipelineFns, outer: Any, where: StagePlan, sizes: dict, widen: bool):
    """How the loop takes the parameters outside the stack into its
    shard_map, and the RowSplit its hooks use: the tables `split_tables`
    names as their row blocks (unless `where.row_blocks` is off), the rest
    whole (gathered at entry); with no such tables, everything whole and no
    RowSplit."""
    stored, names = (where.outer, where.names) if where.row_blocks else (None, None)
    rows = row_tables(fns, outer, stored, names)
    specs = jax.tree.map(lambda r: PartitionSpec("pipe") if r else PartitionSpec(), rows)
    split = split_tables(fns, outer, stored, names)
    return specs, (RowSplit("pipe", sizes["pipe"], widen, split) if split else None)


def _is_table(leaf) -> bool:
    """Tables (two or more dimensions) are what may be stored in row blocks."""
    return leaf.ndim >= 2
