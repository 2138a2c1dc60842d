"""A schedule (schedule.py) compiled into the index tables the pipeline loop
reads at each (tick, device), and one device's row of them at a tick.

The loop (executor.py) runs traced, all devices in step, and can only index fixed
arrays. So everything a schedule decides is worked out here, in numpy,
before tracing: for each part of a tick (its forward, its backward, its
weight gradients) whether it runs, its microbatch and chunk, and the slots
of the buffers it reads and writes; and which devices send at the tick's
end. A forward keeps its input in a stash slot until its backward; an
activation or gradient sent to a neighbour waits in an inbox slot until the
action that uses it; under a split backward, what B keeps for W waits in a
W slot. A slot is taken when a value is written and given back when it is
read, so a device reuses its slots, and each buffer is as large as the most
slots one device holds at once.

Each tick's messages go over one of a few pair lists (`f_pairs`,
`b_pairs`). The loop sends over their union (`Tables.routes`) at every tick,
outside any conditional: a stage with no message sends a value its
neighbour writes into the spare inbox slot. A send chosen per tick under a
conditional is what jaxlib 0.11.2's XLA:CPU started early on some devices
while others still ran the tick's earlier collectives, so they hung in
different ones (docs/pipelines.md#collectives-in-one-order).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.pipeline.schedule import W_PER_TICK, Action, Schedule, whole_backward

Pairs = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule as arrays the loop indexes with (tick, device)."""

    f: np.ndarray  # a forward runs
    f_mb: np.ndarray
    f_chunk: np.ndarray  # local chunk k
    f_first: np.ndarray  # global chunk 0: the forward starts from the embedding
    f_last: np.ndarray  # global chunk G - 1: the forward ends in the loss
    f_read: np.ndarray  # inbox slot of its input (past the first chunk)
    f_stash: np.ndarray  # stash slot its input is kept in
    f_dy: np.ndarray  # last chunk: gradient-inbox slot its loss gradient goes to
    b: np.ndarray  # a backward runs
    b_mb: np.ndarray
    b_chunk: np.ndarray
    b_first: np.ndarray  # global chunk 0: the backward ends in the embedding
    b_stash: np.ndarray  # stash slot of its input
    b_read: np.ndarray  # gradient-inbox slot of its output's gradient
    b_whole: np.ndarray  # its W runs with it, as one backward (always, unless split)
    b_keep: np.ndarray  # split backward: W slot that what W needs is kept in (else: zeros)
    w: np.ndarray  # (ticks, p, W_PER_TICK): a weight gradient runs
    w_chunk: np.ndarray
    w_slot: np.ndarray  # W slot it reads
    fwd_arrival: np.ndarray  # slot for the activation arriving at the end of this tick
    bwd_arrival: np.ndarray  # slot for the gradient arriving at the end of this tick
    slots: tuple[int, int, int, int]  # (stash, forward inbox, gradient inbox, W buffer) sizes
    f_send: np.ndarray  # (ticks,): index into f_pairs of the tick's activation sends
    b_send: np.ndarray  # (ticks,): index into b_pairs of its gradient sends
    f_pairs: tuple[Pairs, ...]  # (source, target) lists of activation sends; the first empty
    b_pairs: tuple[Pairs, ...]  # the same for gradients

    @classmethod
    def tables(cls) -> tuple[str, ...]:
        """The per-(tick, device) arrays, by field name."""
        return tuple(f.name for f in dataclasses.fields(cls)
                     if f.name not in ("slots", "f_send", "b_send", "f_pairs", "b_pairs"))

    @classmethod
    def of(cls, s: Schedule) -> "Program":
        return _Compiler(s).program()

    def ends(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per tick, the microbatch whose forward starts (on the first chunk),
        the one whose forward finishes (on the last chunk) and the one whose
        backward finishes (on the first chunk), or -1: the ticks at which
        tables in row blocks are used by every stage. A tick has at most one
        of each, since one device holds each end chunk."""
        out = []
        for run, mb, at in ((self.f, self.f_mb, self.f_first), (self.f, self.f_mb, self.f_last),
                            (self.b, self.b_mb, self.b_first)):
            hit = (run == 1) & (at == 1)
            out.append(np.where(hit.any(1), (mb * hit).sum(1), -1).astype(np.int32))
        return out[0], out[1], out[2]

    def messages(self) -> int:
        """Messages the schedule sends in a step (activations and gradients)."""
        return (sum(len(self.f_pairs[i]) for i in self.f_send)
                + sum(len(self.b_pairs[i]) for i in self.b_send))

    def routes(self) -> tuple[Pairs, Pairs]:
        """Every pair a message goes over, activations' and gradients': a
        permutation each, since a stage sends only to its next (activations)
        or its previous (gradients)."""
        return tuple(tuple(sorted({pair for pairs in lists for pair in pairs}))
                     for lists in (self.f_pairs, self.b_pairs))

    def transfers(self) -> int:
        """What the loop sends in a step: over every route at every tick,
        `messages()` of them carrying one."""
        return self.f.shape[0] * sum(len(r) for r in self.routes())


def kept_ticks(b: np.ndarray, b_whole: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per tick, whether the W buffer is used: some device keeps a B's taps
    for a later W, or runs such a W."""
    return ((b == 1) & (b_whole == 0)).any(1) | w.any((1, 2))


class _Slots:
    """One buffer's slots (the stash, an inbox, the W buffer), per device:
    taken by the value written into them, given back when it is read."""

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

    def held(self, d: int) -> set[int]:
        return {slot for (device, *_), slot in self._held.items() if device == d}

    @property
    def size(self) -> int:
        """Slots the buffer needs: the most one device opened (at least one).
        Slots are per device; the arrays are sized by the largest need."""
        return max(max(self._opened), 1)


class _Compiler:
    """Fills a Program's tables tick by tick, in the order the loop runs
    them: each device's forward, backward and weight gradients, then the
    messages sent at the tick's end."""

    def __init__(self, s: Schedule):
        self.s = s
        shape = (s.ticks, s.p)
        self.arr = {k: np.zeros(shape + ((W_PER_TICK,) if k.startswith("w") else ()), np.int32)
                    for k in Program.tables()}
        self.stash, self.fwd, self.bwd, self.keep = (_Slots(s.p) for _ in range(4))
        self.pairs: tuple[dict[Pairs, int], ...] = ({(): 0}, {(): 0})
        self.sends = np.zeros((2, s.ticks), np.int32)
        self.unkept: list[tuple[int, int, set[int]]] = []  # (tick, device, W slots held)

    def program(self) -> Program:
        for t, row in enumerate(self.s.table):
            for d, actions in enumerate(row):
                whole = whole_backward(actions)
                for a in actions:
                    if a.kind == "F":
                        self.forward(t, d, a)
                # A tick's Ws read their W slots before its B writes one, so
                # the B may take a slot a W of the same tick gives back.
                own = [(a.mb, a.chunk) for a in actions if a.kind == "B" and whole]
                for j, a in enumerate(a for a in actions
                                      if a.kind == "W" and (a.mb, a.chunk) not in own):
                    self.weight(t, d, a, j)
                for a in actions:
                    if a.kind == "B":
                        self.backward(t, d, a, whole)
                if not any(a.kind == "B" for a in actions) or whole:
                    self.unkept.append((t, d, self.keep.held(d)))
            self.arrivals(t, row)
        # "No arrival" writes into a spare slot past the end.
        self.arr["fwd_arrival"][self.arr["fwd_arrival"] < 0] = self.fwd.size
        self.arr["bwd_arrival"][self.arr["bwd_arrival"] < 0] = self.bwd.size
        slots = (self.stash.size, self.fwd.size, self.bwd.size, self.unkept_slots())
        f_pairs, b_pairs = (tuple(sorted(p, key=p.get)) for p in self.pairs)
        return Program(**self.arr, slots=slots, f_send=self.sends[0], b_send=self.sends[1],
                       f_pairs=f_pairs, b_pairs=b_pairs)

    def unkept_slots(self) -> int:
        """The W buffer's size, after giving each (tick, device) whose B
        keeps nothing a slot to write its zeros into: a free one where
        the tick writes into the W buffer at all, else one past the end."""
        size, arr = self.keep.size, self.arr
        kept = kept_ticks(arr["b"], arr["b_whole"], arr["w"])
        spare = False
        for t, d, held in self.unkept:
            free = [i for i in range(size) if i not in held]
            arr["b_keep"][t, d] = free[0] if free and kept[t] else size
            spare |= bool(kept[t] and not free)
        return size + spare

    def forward(self, t: int, d: int, a: Action) -> None:
        """Reads its input's inbox slot (past the first chunk), stashes the
        input and, on the last chunk, opens the slot of the loss gradient."""
        arr, g = self.arr, self.s.global_chunk(d, a)
        key = (a.mb, a.chunk)
        arr["f"][t, d], arr["f_mb"][t, d], arr["f_chunk"][t, d] = 1, a.mb, a.chunk
        arr["f_first"][t, d], arr["f_last"][t, d] = g == 0, g == self.s.chunks - 1
        if g > 0:
            arr["f_read"][t, d] = self.fwd.give_back(d, key)
        arr["f_stash"][t, d] = self.stash.take(d, key)
        if g == self.s.chunks - 1:
            arr["f_dy"][t, d] = self.bwd.take(d, key)

    def backward(self, t: int, d: int, a: Action, whole: bool) -> None:
        """Reads its stash and its gradient's inbox slot; under a split
        backward whose W runs later (not `whole`: its W is not in the
        tick), opens the W slot of what its W needs."""
        arr, g = self.arr, self.s.global_chunk(d, a)
        key = (a.mb, a.chunk)
        arr["b"][t, d], arr["b_mb"][t, d], arr["b_chunk"][t, d] = 1, a.mb, a.chunk
        arr["b_first"][t, d] = g == 0
        arr["b_whole"][t, d] = whole or not self.s.split_backward
        arr["b_stash"][t, d] = self.stash.give_back(d, key)
        arr["b_read"][t, d] = self.bwd.give_back(d, key)
        if not arr["b_whole"][t, d]:
            arr["b_keep"][t, d] = self.keep.take(d, key)

    def weight(self, t: int, d: int, a: Action, j: int) -> None:
        arr = self.arr
        arr["w"][t, d, j], arr["w_chunk"][t, d, j] = 1, a.chunk
        arr["w_slot"][t, d, j] = self.keep.give_back(d, (a.mb, a.chunk))

    def arrivals(self, t: int, row: tuple[tuple[Action, ...], ...]) -> None:
        """Inbox slots for the messages sent at the end of tick t, taken by
        their receivers (device d gets the activation of d - 1's forward and
        the gradient of d + 1's backward; -1 where none comes), and the
        tick's pair lists."""
        p, G, arr = self.s.p, self.s.chunks, self.arr
        sent: tuple[list, list] = ([], [])
        for d in range(p):
            arr["fwd_arrival"][t, d] = arr["bwd_arrival"][t, d] = -1
            src = (d - 1) % p
            for a in row[src]:
                g = self.s.global_chunk(src, a)
                if a.kind == "F" and g < G - 1:
                    arr["fwd_arrival"][t, d] = self.fwd.take(d, (a.mb, (g + 1) // p))
                    sent[0].append((src, d))
            src = (d + 1) % p
            for a in row[src]:
                g = self.s.global_chunk(src, a)
                if a.kind == "B" and g > 0:
                    arr["bwd_arrival"][t, d] = self.bwd.take(d, (a.mb, (g - 1) // p))
                    sent[1].append((src, d))
        for i, pairs in enumerate(sent):
            known = self.pairs[i]
            self.sends[i, t] = known.setdefault(tuple(sorted(pairs)), len(known))


class Row(NamedTuple):
    """One device's entries of a Program at one tick (traced scalars, the
    fields as Program's; the W fields one per W part), and the number of
    layers in the chunks its forward and backward run. Evaluation uses
    fewer of them; XLA drops the reads it does not use."""

    f: jax.Array
    f_mb: jax.Array
    f_chunk: jax.Array
    f_first: jax.Array
    f_last: jax.Array
    f_read: jax.Array
    f_stash: jax.Array
    f_dy: jax.Array
    b: jax.Array
    b_mb: jax.Array
    b_chunk: jax.Array
    b_first: jax.Array
    b_whole: jax.Array
    b_stash: jax.Array
    b_read: jax.Array
    b_keep: jax.Array
    w: jax.Array
    w_chunk: jax.Array
    w_slot: jax.Array
    fwd_arrival: jax.Array
    bwd_arrival: jax.Array
    f_layers: jax.Array  # of the forward's chunk's slots, how many hold layers
    b_layers: jax.Array  # the same for the backward's (and its W's) chunk


class Tables:
    """A Program's tables as device arrays, read at a traced (tick, device)."""

    def __init__(self, program: Program, counts: np.ndarray):
        self.ticks, self.p = program.f.shape
        self.slots = program.slots
        self.routes = program.routes()
        self.kept = kept_ticks(program.b, program.b_whole, program.w)
        self.arrays = {k: jnp.asarray(getattr(program, k)) for k in Program.tables()}
        self.counts = jnp.asarray(counts)  # layers in each (device, local chunk)

    def runs(self) -> list[tuple[int, int, bool]]:
        """(start, stop, kept): the ticks in runs alike, `kept` where some
        device keeps taps for a later W or runs such a W (split backward)."""
        kept = self.kept
        edges = [0, *(t for t in range(1, self.ticks) if kept[t] != kept[t - 1]), self.ticks]
        return [(a, b, bool(kept[a])) for a, b in zip(edges, edges[1:])]

    def at(self, t: jax.Array, d: jax.Array) -> Row:
        e = {k: a[t, d] for k, a in self.arrays.items()}
        return Row(**e, f_layers=self.counts[d, e["f_chunk"]], b_layers=self.counts[d, e["b_chunk"]])
