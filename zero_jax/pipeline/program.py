"""A schedule (schedule.py) compiled into the index tables the pipeline loop
reads at each (tick, device), and one device's row of them at a tick.

The loop (executor.py) runs traced, in lockstep, and can only index fixed
arrays. So everything a schedule decides is worked out here, in numpy,
before tracing: each action's kind, microbatch and chunk, and the slots of
the buffers it reads and writes. A forward keeps its input in a stash slot
until its backward; an activation or gradient sent to a neighbour waits in
an inbox slot until the action that uses it. A slot is taken when a value is
written and given back when it is read, so a device reuses its slots, and
each buffer is as large as the most slots one device holds at once: m
stashed inputs under gpipe, at most p under 1f1b.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.pipeline.schedule import Action, Schedule

NOP, FWD, BWD = 0, 1, 2


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
        return _Compiler(s).program()

    def ends(self) -> tuple[np.ndarray, np.ndarray]:
        """Per tick, the microbatch whose forward starts (on the first chunk)
        and the one whose forward finishes (on the last chunk), or -1."""
        out = []
        for at in (self.first, self.last):
            hit = (self.kind == FWD) & (at == 1)
            out.append(np.where(hit.any(1), (self.mb * hit).sum(1), -1).astype(np.int32))
        return out[0], out[1]


class _Slots:
    """One buffer's slots (the stash, or an inbox), per device: taken by
    the value written into them, given back when it is read."""

    def __init__(self, p: int):
        self._free: list[list[int]] = [[] for _ in range(p)]
        self._opened = [0] * p  # slots each device has opened
        self._held: dict[tuple, int] = {}  # (device, microbatch, chunk) -> slot

    def take(self, d: int, key: tuple[int, int]) -> int:
        if self._free[d]:
            slot = self._free[d].pop()
        else:
            slot = self._opened[d]
            self._opened[d] += 1
        self._held[(d, *key)] = slot
        return slot

    def give_back(self, d: int, key: tuple[int, int]) -> int:
        slot = self._held.pop((d, *key))
        self._free[d].append(slot)
        return slot

    @property
    def size(self) -> int:
        """Slots the buffer needs: the most one device opened (at least one).
        Slots are per device; the arrays are sized by the largest need."""
        return max(max(self._opened), 1)


class _Compiler:
    """Fills a Program's tables tick by tick, in the order the loop runs
    them: each device's action, then the messages sent at the tick's end."""

    def __init__(self, s: Schedule):
        self.s = s
        self.arr = {k: np.zeros((s.ticks, s.p), np.int32) for k in Program.tables()}
        self.stash, self.fwd, self.bwd = _Slots(s.p), _Slots(s.p), _Slots(s.p)

    def program(self) -> Program:
        for t, row in enumerate(self.s.table):
            for d, a in enumerate(row):
                if a is not None:
                    self.action(t, d, a)
            self.arrivals(t, row)
        slots = (self.stash.size, self.fwd.size, self.bwd.size)
        # "No arrival" writes into a spare slot past the end.
        self.arr["fwd_arrival"][self.arr["fwd_arrival"] < 0] = slots[1]
        self.arr["bwd_arrival"][self.arr["bwd_arrival"] < 0] = slots[2]
        return Program(**self.arr, slots=slots)

    def action(self, t: int, d: int, a: Action) -> None:
        """Device d's entries at tick t: a forward reads its input's inbox
        slot (past the first chunk) and stashes the input (and, on the last
        chunk, opens the slot of the loss gradient); a backward reads its
        stash and its gradient's inbox slot."""
        arr, G = self.arr, self.s.chunks
        g = self.s.global_chunk(d, a)
        arr["kind"][t, d] = FWD if a.kind == "F" else BWD
        arr["mb"][t, d], arr["chunk"][t, d] = a.mb, a.chunk
        arr["first"][t, d], arr["last"][t, d] = g == 0, g == G - 1
        key = (a.mb, a.chunk)
        if a.kind == "F":
            if g > 0:
                arr["read"][t, d] = self.fwd.give_back(d, key)
            arr["stash"][t, d] = self.stash.take(d, key)
            if g == G - 1:
                arr["dy"][t, d] = self.bwd.take(d, key)
        else:
            arr["stash"][t, d] = self.stash.give_back(d, key)
            arr["read"][t, d] = self.bwd.give_back(d, key)

    def arrivals(self, t: int, row: tuple[Action | None, ...]) -> None:
        """Inbox slots for the messages sent at the end of tick t, taken by
        their receivers: device d gets the activation of d - 1's forward
        and the gradient of d + 1's backward, -1 where none comes."""
        p, G, arr = self.s.p, self.s.chunks, self.arr
        for d in range(p):
            arr["fwd_arrival"][t, d] = arr["bwd_arrival"][t, d] = -1
            sender = row[(d - 1) % p]
            if sender is not None and sender.kind == "F":
                g = self.s.global_chunk((d - 1) % p, sender)
                if g < G - 1:
                    arr["fwd_arrival"][t, d] = self.fwd.take(d, (sender.mb, (g + 1) // p))
            sender = row[(d + 1) % p]
            if sender is not None and sender.kind == "B":
                g = self.s.global_chunk((d + 1) % p, sender)
                if g > 0:
                    arr["bwd_arrival"][t, d] = self.bwd.take(d, (sender.mb, (g - 1) // p))


class Row(NamedTuple):
    """One device's entries of a Program at one tick (traced scalars, the
    fields as Program's), and the number of layers in the chunk it runs.
    Evaluation uses fewer of them; XLA drops the reads it does not use."""

    kind: jax.Array
    mb: jax.Array
    chunk: jax.Array
    first: jax.Array
    last: jax.Array
    stash: jax.Array
    read: jax.Array
    dy: jax.Array
    fwd_arrival: jax.Array
    bwd_arrival: jax.Array
    layers: jax.Array  # of the chunk's slots, how many hold layers (the rest pass x through)


class Tables:
    """A Program's tables as device arrays, read at a traced (tick, device)."""

    def __init__(self, program: Program, counts: np.ndarray):
        self.ticks, self.p = program.kind.shape
        self.slots = program.slots
        self.arrays = {k: jnp.asarray(getattr(program, k)) for k in Program.tables()}
        self.counts = jnp.asarray(counts)  # layers in each (device, local chunk)

    def at(self, t: jax.Array, d: jax.Array) -> Row:
        entries = {k: a[t, d] for k, a in self.arrays.items()}
        return Row(**entries, layers=self.counts[d, entries["chunk"]])
