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
assigned when the table is compiled (`Program`), so the loop indexes fixed
arrays.

The layer stack is stored in layer order, split over `pipe` into contiguous
stages. The interleaved schedule needs device d to hold chunks d, d + p, ...,
so for v > 1 the stack is regrouped (an all-to-all over `pipe`) on the way in
and its gradients on the way out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zero_jax.accumulate import split_microbatches
from zero_jax.loss import cross_entropy
from zero_jax.schedule import Schedule

NOP, FWD, BWD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PipelineFns:
    """A model cut for pipelining: embedding, any run of stacked layers, head."""

    split: Callable[[Any], tuple[Any, Any]]  # params -> (outer params, stacked layers)
    merge: Callable[[Any, Any], Any]  # (outer, stacked) -> params
    embed: Callable[[Any, jax.Array, Any], jax.Array]  # (outer, tokens B x T, hooks) -> x
    stage: Callable[[Any, jax.Array, Any], jax.Array]  # (stacked slice, x, hooks) -> x
    head: Callable[[Any, jax.Array, Any], jax.Array]  # (outer, x, hooks) -> logits


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule as arrays the loop indexes with (tick, device)."""

    kind: np.ndarray  # NOP / FWD / BWD
    mb: np.ndarray  # microbatch
    chunk: np.ndarray  # local chunk k
    first: np.ndarray  # global chunk 0: forward starts from the embedding
    last: np.ndarray  # global chunk G - 1: forward ends in the loss
    stash: np.ndarray  # stash slot written by F, read by B
    read: np.ndarray  # F: inbox slot of its input; B: inbox slot of its gradient
    dy: np.ndarray  # F on the last chunk: gradient slot its loss gradient goes to
    fwd_arrival: np.ndarray  # slot for the activation arriving at the end of this tick
    bwd_arrival: np.ndarray  # slot for the gradient arriving at the end of this tick
    slots: tuple[int, int, int]  # (stash, forward inbox, backward inbox) sizes

    @classmethod
    def tables(cls) -> tuple[str, ...]:
        """The per-(tick, device) arrays, by field name."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "slots")

    @classmethod
    def of(cls, s: Schedule) -> "Program":
        T, p, G = s.ticks, s.p, s.chunks
        z = lambda: np.zeros((T, p), np.int32)
        arr = {k: z() for k in cls.tables()}
        free = {name: [[] for _ in range(p)] for name in ("stash", "fwd", "bwd")}
        used = {name: [0] * p for name in free}  # slots each device has opened
        held: dict[tuple, int] = {}

        def take(name, d):
            if free[name][d]:
                return free[name][d].pop()
            used[name][d] += 1
            return used[name][d] - 1

        def alloc(name, d, key):
            # Slots are per device; the arrays are sized by the largest need.
            slot = take(name, d)
            held[(name, d) + key] = slot
            return slot

        def release(name, d, key):
            slot = held.pop((name, d) + key)
            free[name][d].append(slot)
            return slot

        for t, row in enumerate(s.table):
            for d, a in enumerate(row):
                if a is None:
                    continue
                g = a.chunk * p + d
                arr["kind"][t, d] = FWD if a.kind == "F" else BWD
                arr["mb"][t, d], arr["chunk"][t, d] = a.mb, a.chunk
                arr["first"][t, d], arr["last"][t, d] = g == 0, g == G - 1
                key = (a.mb, a.chunk)
                if a.kind == "F":
                    if g > 0:
                        arr["read"][t, d] = release("fwd", d, key)
                    arr["stash"][t, d] = alloc("stash", d, key)
                    if g == G - 1:
                        arr["dy"][t, d] = alloc("bwd", d, key)
                else:
                    arr["stash"][t, d] = release("stash", d, key)
                    arr["read"][t, d] = release("bwd", d, key)
            for d in range(p):  # messages sent this tick, stored by their receivers
                arr["fwd_arrival"][t, d] = arr["bwd_arrival"][t, d] = -1
                sender = row[(d - 1) % p]
                if sender is not None and sender.kind == "F":
                    g = sender.chunk * p + (d - 1) % p
                    if g < G - 1:
                        arr["fwd_arrival"][t, d] = alloc("fwd", d, (sender.mb, (g + 1) // p))
                sender = row[(d + 1) % p]
                if sender is not None and sender.kind == "B":
                    g = sender.chunk * p + (d + 1) % p
                    if g > 0:
                        arr["bwd_arrival"][t, d] = alloc("bwd", d, (sender.mb, (g - 1) // p))
        slots = tuple(max(max(used[name]), 1) for name in ("stash", "fwd", "bwd"))
        # "No arrival" writes into a spare slot past the end.
        arr["fwd_arrival"][arr["fwd_arrival"] < 0] = slots[1]
        arr["bwd_arrival"][arr["bwd_arrival"] < 0] = slots[2]
        return cls(**arr, slots=slots)


def _interleave(tree: Any, p: int, v: int, inverse: bool = False) -> Any:
    """Layer order <-> the order where device d's block holds chunks d, d + p, ..."""
    if v == 1:
        return tree

    def move(x):
        c = x.shape[0] // (p * v)
        rest = x.shape[1:]
        if inverse:  # (p, v, c) -> (v, p, c)
            return x.reshape(p, v, c, *rest).swapaxes(0, 1).reshape(x.shape)
        return x.reshape(v, p, c, *rest).swapaxes(0, 1).reshape(x.shape)

    return jax.tree.map(move, tree)


def loss_and_grads(fns: PipelineFns, hooks, schedule: Schedule, mesh: Mesh, params: Any,
                   batch: jax.Array, scale: jax.Array, stack_specs: Any, grad_dtype,
                   stage_grad_specs: Any, gather_specs: Any = None) -> tuple[jax.Array, Any]:
    """Mean loss (times `scale`) and gradients of `params` over `batch`, pipelined.

    `stack_specs` are the stacked parameters' PartitionSpecs (first dimension
    over `pipe`); `stage_grad_specs` lay out a stage's gradient accumulator
    (its chunks, `pipe` left out). `gather_specs` (outer, stacked), if given,
    gather a stage's parameters once per step instead of once per microbatch.
    """
    p, m, v = schedule.p, schedule.m, schedule.v
    prog = Program.of(schedule)
    outer, stack = fns.split(params)
    stack = _interleave(stack, p, v)
    stack = jax.lax.with_sharding_constraint(
        stack, jax.tree.map(lambda s: NamedSharding(mesh, s), stack_specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec)))
    micro = split_microbatches(batch, m)
    table = {k: jnp.asarray(getattr(prog, k)) for k in Program.tables()}
    n_stash, n_fwd, n_bwd = prog.slots
    x_shape = jax.eval_shape(lambda o, t: fns.embed(o, t[:, :-1], hooks), outer, micro[0])

    def body(outer, stack, micro, scale):
        d = jax.lax.axis_index("pipe")
        # Inside, shardings refer to the context mesh, whose `pipe` is manual.
        inner = jax.sharding.get_abstract_mesh()
        hooks_in = dataclasses.replace(hooks, mesh=inner)
        if gather_specs is not None:
            # Already in the compute layout: the hooks must not re-shard them.
            hooks_in = dataclasses.replace(hooks_in, stored=None)
        pin = lambda tree, specs: jax.lax.with_sharding_constraint(tree, jax.tree.map(
            lambda s: NamedSharding(inner, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
        constrain_stage_grads = lambda g: pin(g, stage_grad_specs)
        if gather_specs is not None:  # ZeRO-3: gather here, before the loop, once
            outer, stack = pin(outer, gather_specs[0]), pin(stack, gather_specs[1])
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), stack)
        # Activation buffers are laid out like the activations (batch split).
        place = lambda buf: hooks_in.act(buf, (None, "batch", "res_seq", "embed"))
        act = lambda x: hooks_in.act(x, ("batch", "res_seq", "embed"))
        zeros = lambda n: place(jnp.zeros((n, *x_shape.shape), x_shape.dtype))
        carry = {  # inboxes have one spare slot, where "nothing arrived" is written
            "fwd": zeros(n_fwd + 1), "bwd": zeros(n_bwd + 1), "stash": zeros(n_stash),
            "g_stack": constrain_stage_grads(jax.tree.map(lambda a: jnp.zeros(a.shape, grad_dtype), chunks)),
            "g_outer": jax.tree.map(lambda a: jnp.zeros(a.shape, grad_dtype), outer),
            "loss": jnp.zeros((), jnp.float32),
        }

        def head_loss(o, y, tokens):
            return cross_entropy(fns.head(o, y, hooks_in), tokens[:, 1:]) * scale / m

        zero_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        zero_g_outer = jax.tree.map(lambda a: jnp.zeros(a.shape, grad_dtype), outer)
        zero_g_chunk = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], grad_dtype), chunks)

        # Each branch returns the same small tuple; the buffers are updated
        # outside the switch, in place, instead of passing through it.
        #   (stash this, send on, send back, loss gradient, chunk grads, outer grads, loss)
        def fwd(c, row):
            tokens = micro[row["mb"]]
            x = jax.lax.cond(row["first"], lambda: act(fns.embed(outer, tokens[:, :-1], hooks_in)),
                             lambda: act(c["fwd"][row["read"]]))
            y = act(fns.stage(jax.tree.map(lambda a: a[row["chunk"]], chunks), x, hooks_in))

            def ends():
                loss, (g_o, dy) = jax.value_and_grad(head_loss, argnums=(0, 1))(outer, y, tokens)
                return loss, jax.tree.map(lambda g: g.astype(grad_dtype), g_o), act(dy)

            loss, g_o, dy = jax.lax.cond(row["last"], ends,
                                         lambda: (jnp.zeros((), jnp.float32), zero_g_outer, zero_x))
            return x, jnp.where(row["last"], zero_x, y), zero_x, dy, zero_g_chunk, g_o, loss

        def bwd(c, row):
            chunk = jax.tree.map(lambda a: a[row["chunk"]], chunks)
            x, dy = c["stash"][row["stash"]], c["bwd"][row["read"]]
            _, vjp = jax.vjp(lambda w, x: fns.stage(w, x, hooks_in), chunk, x)
            g_chunk, dx = vjp(dy)
            g_chunk = jax.tree.map(lambda g: g.astype(grad_dtype), g_chunk)

            def starts():
                tokens = micro[row["mb"]]
                _, vjp_embed = jax.vjp(lambda o: fns.embed(o, tokens[:, :-1], hooks_in), outer)
                return jax.tree.map(lambda g: g.astype(grad_dtype), vjp_embed(dx)[0])

            g_o = jax.lax.cond(row["first"], starts, lambda: zero_g_outer)
            dx = act(dx)
            return (zero_x, zero_x, jnp.where(row["first"], zero_x, dx), zero_x, g_chunk, g_o,
                    jnp.zeros((), jnp.float32))

        def nop(c, row):
            return (zero_x, zero_x, zero_x, zero_x, zero_g_chunk, zero_g_outer,
                    jnp.zeros((), jnp.float32))

        def tick(t, c):
            row = {k: v[t, d] for k, v in table.items()}
            is_f, is_b = row["kind"] == FWD, row["kind"] == BWD
            x, to_next, to_prev, dy, g_chunk, g_o, loss = jax.lax.switch(
                row["kind"], [nop, fwd, bwd], c, row)
            stash = c["stash"].at[row["stash"]].set(
                jnp.where(is_f, x, c["stash"][row["stash"]]))
            bwd_box = c["bwd"].at[row["dy"]].set(
                jnp.where(is_f & row["last"], dy, c["bwd"][row["dy"]]))
            g_stack = jax.tree.map(
                lambda a, g: a.at[row["chunk"]].add(jnp.where(is_b, g, jnp.zeros_like(g))),
                c["g_stack"], g_chunk)
            to_next = jax.lax.ppermute(to_next, "pipe", [(i, (i + 1) % p) for i in range(p)])
            to_prev = jax.lax.ppermute(to_prev, "pipe", [(i, (i - 1) % p) for i in range(p)])
            return {
                "stash": place(stash),
                "fwd": place(c["fwd"].at[row["fwd_arrival"]].set(to_next)),
                "bwd": place(bwd_box.at[row["bwd_arrival"]].set(to_prev)),
                "g_stack": constrain_stage_grads(g_stack),
                "g_outer": jax.tree.map(jnp.add, c["g_outer"], g_o),
                "loss": c["loss"] + loss,
            }

        c = jax.lax.fori_loop(0, schedule.ticks, tick, carry)
        g_stack = jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]),
                               c["g_stack"])
        return (jax.lax.psum(c["loss"], "pipe"), jax.lax.psum(c["g_outer"], "pipe"), g_stack)

    replicated = jax.tree.map(lambda _: PartitionSpec(), outer)
    piped = jax.tree.map(lambda _: PartitionSpec("pipe"), stack)
    run = jax.shard_map(body, mesh=mesh, in_specs=(replicated, piped, PartitionSpec(), PartitionSpec()),
                        out_specs=(PartitionSpec(), replicated, piped), axis_names={"pipe"},
                        check_vma=False)
    loss, g_outer, g_stack = run(outer, stack, micro, scale)
    return loss, fns.merge(g_outer, _interleave(g_stack, p, v, inverse=True))
