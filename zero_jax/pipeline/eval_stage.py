"""What a device does at one tick of the evaluation loop: a forward
through one of its chunks and, on the last chunk, the microbatch's loss.
Nothing is kept for a backward pass; only activations move over `pipe`.

With the embedding and head tables stored in row blocks over `pipe`
(`rows`, executor.py), the first chunk's lookup and the last chunk's logits
run on every stage at once, each on the rows it holds (`infer_split`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zero_jax.model.hooks import RowSplit
from zero_jax.model.loss import cross_entropy
from zero_jax.pipeline.program import Row, Tables
from zero_jax.model.contract import PipelineFns
from zero_jax.pipeline.records import StagePlan
from zero_jax.pipeline.stage import Held, LocalStage, send


class EvalCarry(NamedTuple):
    """The evaluation loop's state from tick to tick, on one device."""

    fwd: jax.Array  # forward inbox: activations waiting for their F (one spare slot)
    loss: jax.Array  # loss sum so far


class EvalStage(LocalStage):
    """A device's stage in the evaluation loop. With `rows`, the embedding
    and head tables are this device's row blocks of them."""

    def __init__(self, fns: PipelineFns, hooks, where: StagePlan, held: Held,
                 x_shape: jax.ShapeDtypeStruct, rows: RowSplit | None):
        super().__init__(fns, hooks, where, held, x_shape)
        self.rows = rows
        self.ends = dataclasses.replace(hooks, rows=rows)  # the embedding's and head's hooks

    def loop(self, tables: Tables, enters: jax.Array, leaves: jax.Array) -> EvalCarry:
        """The carry after every tick of the forward-only program; `enters`
        and `leaves` per tick as `Program.ends` gives them (its first two)."""
        d = jax.lax.axis_index("pipe")
        p = tables.p

        def tick(t, c):
            row = tables.at(t, d)
            if self.rows is None:
                out, part = jax.lax.cond(row.f, lambda: self.infer(c.fwd, row), self.nothing)
            else:
                out, part = self.infer_split(c.fwd, row, enters[t], leaves[t])
                part = jnp.where(d == p - 1, part, 0.0)  # every stage has it: count it once
            arrived = send(out, tables.routes[0])
            return EvalCarry(fwd=self.place(c.fwd.at[row.fwd_arrival].set(arrived)),
                             loss=c.loss + part)

        start = EvalCarry(fwd=self.buffer(tables.slots[1] + 1), loss=self.no_loss())
        return jax.lax.fori_loop(0, tables.ticks, tick, start)

    def no_loss(self) -> jax.Array:
        return jnp.zeros((), jnp.float32)

    def nothing(self) -> tuple[jax.Array, jax.Array]:
        """What a tick without a forward sends, and adds to the loss."""
        return self.x_zero, self.no_loss()

    def infer(self, inbox, row: Row) -> tuple[jax.Array, jax.Array]:
        """(output for the next stage, the microbatch's loss on the last chunk)."""
        h = self.hooks
        mb = self.microbatch(row.f_mb)
        x = jax.lax.cond(row.f_first, lambda: self.embed(mb["inputs"], h),
                         lambda: self.act(inbox[row.f_read]))
        y = self.act(self.run(self.chunk(row.f_chunk), x, h, row.f_layers)[0])

        def loss():
            return cross_entropy(self.fns.head(self.outer, y, h), mb["targets"],
                                 mb["weights"])

        part = jax.lax.cond(row.f_last, loss, self.no_loss)
        return jnp.where(row.f_last, self.x_zero, y), part

    def infer_split(self, inbox, row: Row, enters, leaves) -> tuple[jax.Array, jax.Array]:
        """`infer` with the tables in row blocks over `pipe`: microbatch
        `enters` (if not -1) is looked up by every stage for the first
        chunk, and the output of microbatch `leaves` (if not -1) sent from
        the last to every stage for the loss. Those two conditions are the
        tick's, the same on every device, as collectives over `pipe` need."""
        x0 = jax.lax.cond(enters >= 0,
                          lambda: self.embed(self.microbatch(enters)["inputs"], self.ends),
                          lambda: self.x_zero)
        x = jnp.where(row.f_first, x0, inbox[row.f_read])
        chunk = self.chunk(row.f_chunk)
        y = jax.lax.cond(row.f, lambda: self.act(self.run(chunk, x, self.hooks, row.f_layers)[0]),
                         lambda: self.x_zero)

        def head_loss():
            out = self.act(self.rows.sum(jnp.where(row.f_last, y, self.x_zero)))
            mb = self.microbatch(leaves)
            return cross_entropy(self.fns.head(self.outer, out, self.ends), mb["targets"],
                                 mb["weights"], self.rows.axis)

        part = jax.lax.cond(leaves >= 0, head_loss, self.no_loss)
        return jnp.where(row.f_last, self.x_zero, y), part
