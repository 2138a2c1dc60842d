"""Pipeline schedules as static tables: which stage does what at each tick.

The layer stack is cut into G = p * v chunks. Device d (a `pipe` index) holds
chunks d, d + p, ..., d + (v - 1) p: with v = 1 one contiguous stage, with
v > 1 Megatron's interleaved (circular) placement. An action is a forward (F)
or backward (B) pass of one microbatch through one of the device's chunks.

A schedule is each device's order of actions; `simulate` turns it into a
table by running every device as early as its inputs allow, one action per
tick (forward and backward counted as one unit each, the convention the
bubble formulas use). A message sent at tick t is usable at tick t + 1.
`cost` prices the table as the loop runs it: a backward costs three
forwards (it recomputes the forward), each tick lasts as long as its
slowest device plus its sends.
Adding a schedule is adding an order function.

    gpipe        every forward, then every backward (all m stashed)
    1f1b         PipeDream-flush: warm-up forwards, then one forward, one
                 backward; at most p microbatches in flight per stage
    interleaved  1f1b over v chunks per device (Megatron); bubble / v
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal, NamedTuple, Sequence

ScheduleName = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = typing.get_args(ScheduleName)


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    mb: int  # microbatch
    chunk: int  # the device's local chunk k; global chunk g = k * p + device


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    p: int  # pipeline stages (devices along `pipe`)
    m: int  # microbatches
    v: int  # chunks per device
    table: tuple[tuple[Action | None, ...], ...]  # [tick][device]

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def chunks(self) -> int:
        return self.p * self.v

    def global_chunk(self, device: int, action: Action) -> int:
        return action.chunk * self.p + device

    @property
    def bubble(self) -> float:
        """Idle fraction of device-ticks (every action one unit: the formulas' convention)."""
        idle = sum(a is None for row in self.table for a in row)
        return idle / (self.ticks * self.p)

    def max_in_flight(self) -> int:
        """Most (microbatch, chunk) forwards awaiting their backward on one device."""
        worst = 0
        for d in range(self.p):
            live = 0
            for row in self.table:
                a = row[d]
                live += (a is not None and a.kind == "F") - (a is not None and a.kind == "B")
                worst = max(worst, live)
        return worst

    def chart(self) -> str:
        """One line per stage, one column per tick: F3 / B3 (chunk letter if v > 1), '.' idle."""
        width = len(str(self.m - 1)) + 1 + (self.v > 1)
        lines = []
        for d in range(self.p):
            cells = []
            for row in self.table:
                a = row[d]
                text = "." if a is None else f"{a.kind}{a.mb}" + (chr(97 + a.chunk) if self.v > 1 else "")
                cells.append(text.ljust(width))
            lines.append(f"stage {d}: " + " ".join(cells).rstrip())
        return "\n".join(lines)


class Cost(NamedTuple):
    """A schedule's time in units of one layer's forward pass, one microbatch."""

    total: float  # the step: every tick lasts its slowest action, then its sends
    busy: float  # work done, summed over devices
    sends: float  # of `total`, the ticks' sends
    ticks: tuple[float, ...]  # each tick's length

    @property
    def bubble(self) -> float:
        """Idle fraction of the devices' time: 1 - busy / (p x total)."""
        p = self.p
        return 1 - self.busy / (p * self.total) if self.total else 0.0

    p: int = 1


def cost(s: Schedule, layers: Sequence[float], head: float = 0.0, embed: float = 0.0,
         send: float = 0.0, backward: float = 3.0) -> Cost:
    """The time of the lockstep loop that runs `s` (executor.py).

    `layers[g]`: layers in global chunk g. A forward costs its layers (1
    each), plus the embedding on chunk 0 (`embed`) and, on the last chunk,
    the head's forward and backward (3 `head`: it runs in the same tick).
    A backward recomputes the chunk's forward from its stashed input, then
    runs the backward proper (twice the forward's FLOPs): `backward` = 3 per
    layer (4 where each block is rematerialised again inside it), plus the
    embedding's backward on chunk 0. Every tick ends in the two
    `ppermute`s of the loop (`send` each tick, not overlapped), and lasts as
    long as its slowest device, since all devices wait at those sends.
    """
    G = s.chunks

    def of(d: int, a: Action | None) -> float:
        if a is None:
            return 0.0
        g = s.global_chunk(d, a)
        if a.kind == "F":
            return layers[g] + (embed if g == 0 else 0) + (3 * head if g == G - 1 else 0)
        return backward * layers[g] + (embed if g == 0 else 0)

    work = [[of(d, a) for d, a in enumerate(row)] for row in s.table]
    ticks = tuple(max(row) + send for row in work)
    return Cost(sum(ticks), sum(map(sum, work)), send * len(ticks), ticks, s.p)


def _gpipe(p: int, m: int, v: int, d: int) -> list[Action]:
    return [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]


def _one_f_one_b(p: int, m: int, v: int, d: int) -> list[Action]:
    warm = min(p - d - 1, m)
    order = [Action("F", i, 0) for i in range(warm)]
    for i in range(m - warm):
        order += [Action("F", warm + i, 0), Action("B", i, 0)]
    return order + [Action("B", i, 0) for i in range(m - warm, m)]


def _interleaved(p: int, m: int, v: int, d: int) -> list[Action]:
    # Megatron's order: microbatches in groups of p; within a group, every
    # chunk in turn (forward: 0..v-1, backward: v-1..0).
    forwards = [Action("F", g + i, k) for g in range(0, m, p) for k in range(v) for i in range(p)]
    backwards = [Action("B", g + i, k) for g in range(0, m, p) for k in reversed(range(v))
                 for i in range(p)]
    warm = min((p - d - 1) * 2 + (v - 1) * p, m * v)
    order = forwards[:warm]
    for i in range(m * v - warm):
        order += [forwards[warm + i], backwards[i]]
    return order + backwards[m * v - warm:]


_ORDERS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}


def check_shape(name: str, p: int, m: int, v: int) -> None:
    """Errors before anything is built, naming the sizes and the fix."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r}: choose from {', '.join(SCHEDULES)}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"--virtual-stages {v} applies to the interleaved schedule only")
    if v < 1 or m < 1:
        raise ValueError("microbatches and virtual stages must be >= 1")
    if name == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs microbatches ({m}) divisible by "
                         f"pipe ({p}); use --microbatches {-(-m // p) * p}")


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The table of schedule `name` for p stages, m microbatches, v chunks per device."""
    if name not in _ORDERS:
        raise ValueError(f"pipeline schedule {name!r}: choose from {', '.join(SCHEDULES)}")
    orders = [_ORDERS[name](p, m, v, d) for d in range(p)]
    return Schedule(name, p, m, v, simulate(orders, p, m, v))


def forward_only(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Schedule `name`'s forwards alone (evaluation): each device's forwards in
    the order the schedule runs them, as early as their inputs allow."""
    if name not in _ORDERS:
        raise ValueError(f"pipeline schedule {name!r}: choose from {', '.join(SCHEDULES)}")
    orders = [[a for a in _ORDERS[name](p, m, v, d) if a.kind == "F"] for d in range(p)]
    return Schedule(f"{name} (forward)", p, m, v, simulate(orders, p, m, v))


def simulate(orders: list[list[Action]], p: int, m: int, v: int) -> tuple[tuple[Action | None, ...], ...]:
    """Run each device's order as early as dependencies allow, one action per tick."""
    G = p * v
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, global chunk) -> tick finished
    position = [0] * p
    table = []
    while any(position[d] < len(orders[d]) for d in range(p)):
        t = len(table)
        row: list[Action | None] = []
        for d in range(p):
            if position[d] == len(orders[d]):
                row.append(None)
                continue
            a = orders[d][position[d]]
            g = a.chunk * p + d
            if a.kind == "F":
                needs = [("F", a.mb, g - 1)] if g > 0 else []
            else:
                needs = [("F", a.mb, g)] + ([("B", a.mb, g + 1)] if g < G - 1 else [])
            if all(done.get(n, t) < t for n in needs):
                row.append(a)
                position[d] += 1
            else:
                row.append(None)
        for d, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.mb, a.chunk * p + d)] = t
        table.append(tuple(row))
        if t > 4 * (m * v + p) * 2 + 10:
            raise RuntimeError("schedule does not complete: its order has a cycle")
    return tuple(table)


def violations(s: Schedule) -> list[str]:
    """Everything wrong with a table (empty for a valid one); the tests' oracle."""
    problems, when = [], {}
    for t, row in enumerate(s.table):
        for d, a in enumerate(row):
            if a is None:
                continue
            key = (a.kind, a.mb, s.global_chunk(d, a))
            if key in when:
                problems.append(f"{key} runs twice")
            when[key] = t
    for mb in range(s.m):
        for g in range(s.chunks):
            f, b = when.get(("F", mb, g)), when.get(("B", mb, g))
            if f is None or b is None:
                problems.append(f"microbatch {mb} chunk {g}: forward or backward missing")
                continue
            if not f < b:
                problems.append(f"microbatch {mb} chunk {g}: backward at {b} before forward at {f}")
            if g > 0 and not when.get(("F", mb, g - 1), f) < f:
                problems.append(f"microbatch {mb} chunk {g}: forward before its input")
            if g < s.chunks - 1 and not when.get(("B", mb, g + 1), b) < b:
                problems.append(f"microbatch {mb} chunk {g}: backward before its gradient")
    return problems
