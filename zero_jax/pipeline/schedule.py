"""Pipeline schedules as static tables: what each stage does at each tick.

The layer stack is cut into G = p * v chunks. Device d (a `pipe` index) holds
chunks d, d + p, ..., d + (v - 1) p: with v = 1 one contiguous stage, with
v > 1 Megatron's interleaved (circular) placement. An action is a forward
(F), a backward (B) or a weight gradient (W) of one microbatch through one
of the device's chunks.

The loop (executor.py) runs in ticks, all devices in step, since every tick
ends in the sends between neighbours. A tick is fused: a device runs at
most one forward and one backward in it (of different microbatches, or of
the same one on the last chunk, whose loss gradient needs no message), and
in zero-bubble schedules up to `W_PER_TICK` weight gradients, in that
order; then the sends. A message sent at tick t is usable at tick t + 1.
In the steady state of 1F1B every stage runs a forward and a backward per
tick, so no stage waits for a neighbour out of phase with it, and the idle
fraction approaches (p - 1) / (m + p - 1), as in asynchronous 1F1B.

A schedule is each device's order of forwards and of backwards, and how
many forwards it may have in flight (stashed, awaiting their backward);
`simulate` runs each device as early as its inputs and that bound allow.
Zero-bubble schedules split each backward into the input gradient (B, on
the critical path between stages) and the weight gradient (W, on the
device only), and place the Ws where they lengthen no tick (`_place_ws`).

    gpipe        every forward, then every backward (all m stashed)
    1f1b         PipeDream-flush: forwards run ahead only as far as the
                 round trip to the last stage needs, then one forward and
                 one backward per tick
    interleaved  1f1b over v chunks per device (Megatron's order, in rounds
                 of p microbatches; the last round may be shorter)
    zb-h1        1f1b with each W split off and deferred (Qi et al. 2023,
                 arXiv 2401.10241): stage d delays up to 2d of them, into
                 ticks where it would idle

`cost` prices a table as the loop runs it. Adding a schedule is adding an
entry to `_PLANS`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections import deque
from typing import NamedTuple, Sequence

from zero_jax.config.sections import ScheduleName

SCHEDULES: tuple[str, ...] = typing.get_args(ScheduleName)
SPLIT_BACKWARD = frozenset({"zb-h1"})  # schedules whose backward leaves W for later
W_PER_TICK = 2  # weight gradients a device may run in one tick

# Unit costs the zero-bubble placement of W assumes, in layer forwards: the
# input gradient recomputes the chunk's forward and runs the half of the
# backward that gives dx; the weight gradient is one product per matrix.
_UNIT = {"F": 1.0, "B": 2.0, "W": 1.0}


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    mb: int  # microbatch
    chunk: int  # the device's local chunk k; global chunk g = k * p + device


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    p: int  # pipeline stages (devices along `pipe`)
    m: int  # microbatches
    v: int  # chunks per device
    table: tuple[tuple[tuple[Action, ...], ...], ...]  # [tick][device] -> actions, in order

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def chunks(self) -> int:
        return self.p * self.v

    @property
    def split_backward(self) -> bool:
        """Whether backwards give input gradients only, and Ws the weights'."""
        return self.name in SPLIT_BACKWARD

    def global_chunk(self, device: int, action: Action) -> int:
        return action.chunk * self.p + device

    def actions(self, device: int, kind: str) -> list[tuple[int, Action]]:
        """(tick, action) of `kind` on `device`, in order."""
        return [(t, a) for t, row in enumerate(self.table) for a in row[device] if a.kind == kind]

    def stash_peak(self) -> list[int]:
        """Per device, the most forward inputs held at once (a forward's stash
        is written before the same tick's backward frees one)."""
        out = []
        for d in range(self.p):
            live = worst = 0
            for row in self.table:
                for a in row[d]:
                    live += (a.kind == "F") - (a.kind == "B")
                    worst = max(worst, live)
            out.append(worst)
        return out

    def pending_w_peak(self) -> list[int]:
        """Per device, the most weight gradients waiting at once (0 unless
        the backward is split): each holds its chunk's matrix inputs and
        output gradients. A W in its B's tick waits for nothing
        (`whole_backward`)."""
        out = []
        for d in range(self.p):
            live = worst = 0
            for row in self.table:
                acts, whole = row[d], whole_backward(row[d])
                # A tick's Ws read their inputs before its B keeps its own.
                live -= sum(a.kind == "W" for a in acts) - whole
                live += self.split_backward and not whole and any(a.kind == "B" for a in acts)
                worst = max(worst, live)
            out.append(worst)
        return out

    def chart(self) -> str:
        """One line per stage, one column per tick: its actions (F3, B3, W3;
        the chunk letter after the microbatch if v > 1), '.' idle."""
        def cell(actions):
            return "".join(f"{a.kind}{a.mb}" + (chr(97 + a.chunk) if self.v > 1 else "")
                           for a in actions) or "."
        cells = [[cell(row[d]) for row in self.table] for d in range(self.p)]
        widths = [max(len(cells[d][t]) for d in range(self.p)) for t in range(self.ticks)]
        return "\n".join(f"stage {d}: " + " ".join(c.ljust(w) for c, w in zip(cells[d], widths)).rstrip()
                         for d in range(self.p))


class Cost(NamedTuple):
    """A schedule's time in units of one layer's forward pass, one microbatch."""

    total: float  # the step: every tick lasts its slowest device, then its sends
    busy: float  # work done, summed over devices
    sends: float  # of `total`, the ticks' sends (and sums over `pipe`, `shared_ends`)
    ticks: tuple[float, ...]  # each tick's length
    p: int = 1

    @property
    def bubble(self) -> float:
        """Idle fraction of the devices' time: 1 - busy / (p x total)."""
        return 1 - self.busy / (self.p * self.total) if self.total else 0.0


@dataclasses.dataclass(frozen=True)
class Prices:
    """What the parts of a tick cost, in layer forwards of one microbatch (`cost`)."""

    head: float = 0.0  # the head's forward (its forward and backward: 3 x this)
    embed: float = 0.0  # the embedding's forward, and its backward
    send: float = 0.0  # one send between neighbouring stages
    backward: float = 3.0  # a layer's backward with its forward recomputed (4: remat inside)
    weight: float = 1.0  # of `backward`, what a split backward leaves to W
    end_sum: float = 0.0  # one sum of an activation over `pipe` (shared ends)


def cost(s: Schedule, layers: Sequence[float], prices: Prices = Prices(),
         shared_ends: bool = False) -> Cost:
    """The time of the loop that runs `s` (executor.py), at `prices`.

    `layers[g]`: the work of global chunk g, in layer forwards. A forward
    costs its layers, plus the embedding on chunk 0 (`embed`) and, on the
    last chunk, the head's forward and backward (3 `head`: it runs in the
    forward's part of the tick). A backward recomputes the chunk's forward
    from its stashed input and runs the backward proper: `backward` per
    layer (3; 4 where each block is rematerialised again inside it), plus
    the embedding's backward on chunk 0. Where the backward is split, B
    costs `backward - weight` per layer and W `weight` (one product per
    matrix, from the inputs and output gradients B kept). A tick lasts as
    long as its slowest device, then its two sends (`send` each), which
    run at every tick whether they carry a message or not (program.py).

    `shared_ends`: the tables are used in row blocks over `pipe`
    (executor.py), so every device does a p-th of the embedding's and the
    head's work at the ticks that have it, and each such end adds sums of
    one activation over `pipe` (`end_sum` each): one where a microbatch
    enters, two where one leaves, one where one's backward ends.
    """
    G = s.chunks
    split = s.split_backward
    head, embed, backward, weight = prices.head, prices.embed, prices.backward, prices.weight

    def ends(d: int, a: Action) -> tuple[float, int]:
        """The embedding's and head's work in action a, and its sums over `pipe`."""
        g = s.global_chunk(d, a)
        if a.kind == "F":
            return (embed if g == 0 else 0) + (3 * head if g == G - 1 else 0), \
                (g == 0) + 2 * (g == G - 1)
        if a.kind == "B" and g == 0:
            return embed, 1
        return 0.0, 0

    def of(d: int, a: Action) -> float:
        g = s.global_chunk(d, a)
        own = 0.0 if shared_ends else ends(d, a)[0]
        if a.kind == "F":
            return layers[g] + own
        if a.kind == "W":
            return weight * layers[g]
        return (backward - weight * split) * layers[g] + own

    work = [[sum(of(d, a) for a in acts) for d, acts in enumerate(row)] for row in s.table]
    # The loop sends over every route at every tick, carrying a message or
    # not (program.py): a direction costs every tick if any tick uses it.
    ticks_range = range(s.ticks)
    directions = sum(any(_sends(s, t, d, kind) for t in ticks_range for d in range(s.p))
                     for kind in ("F", "B"))
    sends = [prices.send * directions for _ in ticks_range]
    if shared_ends:
        for t, row in enumerate(s.table):
            parts = [ends(d, a) for d, acts in enumerate(row) for a in acts]
            work[t] = [w + sum(e for e, _ in parts) / s.p for w in work[t]]
            sends[t] += prices.end_sum * sum(n for _, n in parts)
    ticks = tuple(max(row) + c for row, c in zip(work, sends))
    return Cost(sum(ticks), sum(map(sum, work)), sum(sends), ticks, s.p)


def _sends(s: Schedule, t: int, d: int, kind: str) -> bool:
    """Whether device d sends a message at the end of tick t: the output of
    a forward (kind F) not on the last chunk, or the input gradient of a
    backward (kind B) not on the first."""
    for a in s.table[t][d]:
        if a.kind == kind:
            g = s.global_chunk(d, a)
            return g < s.chunks - 1 if kind == "F" else g > 0
    return False


# -- orders ------------------------------------------------------------------

class Plan(NamedTuple):
    """One device's part of a schedule: its forwards and backwards in order,
    how many forwards it may have in flight, and whether its backwards wait
    for all of its forwards."""

    forwards: list[Action]
    backwards: list[Action]
    in_flight: int
    after_forwards: bool = False


def _gpipe(p: int, m: int, v: int, d: int) -> Plan:
    return Plan([Action("F", i, 0) for i in range(m)], [Action("B", i, 0) for i in range(m)],
                m, after_forwards=True)


def _one_f_one_b(p: int, m: int, v: int, d: int) -> Plan:
    # A forward's backward comes back 2 (p - d) - 1 ticks later (to the last
    # stage and back, one tick a hop; the last stage's in the same tick), so
    # that many forwards keep stage d busy.
    return Plan([Action("F", i, 0) for i in range(m)], [Action("B", i, 0) for i in range(m)],
                2 * (p - d))


def _interleaved(p: int, m: int, v: int, d: int) -> Plan:
    # Megatron's order, in rounds of p microbatches (the last may be
    # shorter): within a round every chunk in turn, forwards 0..v-1,
    # backwards v-1..0.
    rounds = [range(r, min(r + p, m)) for r in range(0, m, p)]
    forwards = [Action("F", i, k) for mbs in rounds for k in range(v) for i in mbs]
    backwards = [Action("B", i, k) for mbs in rounds for k in reversed(range(v)) for i in mbs]
    return Plan(forwards, backwards, 2 * (p * v - d) + p * (v - 1))


_PLANS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved,
          "zb-h1": _one_f_one_b}


def check_shape(name: str, p: int, m: int, v: int) -> None:
    """Errors before anything is built, naming the sizes and the fix."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r}: choose from {', '.join(SCHEDULES)}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"--virtual-stages {v} applies to the interleaved schedule only")
    if v < 1 or m < 1:
        raise ValueError("microbatches and virtual stages must be >= 1")


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The table of schedule `name` for p stages, m microbatches, v chunks per device."""
    check_shape(name, p, m, v)
    plans = [_PLANS[name](p, m, v, d) for d in range(p)]
    table = simulate(plans, p, v)
    if name in SPLIT_BACKWARD:
        table = _place_ws(table, p, v, defer=[2 * d for d in range(p)])
    return Schedule(name, p, m, v, table)


def forward_only(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Schedule `name`'s forwards alone (evaluation): each device's forwards in
    the order the schedule runs them, as early as their inputs allow."""
    check_shape(name, p, m, v)
    plans = [Plan(_PLANS[name](p, m, v, d).forwards, [], m * v) for d in range(p)]
    return Schedule(f"{name} (forward)", p, m, v, simulate(plans, p, v))


def simulate(plans: list[Plan], p: int, v: int) -> tuple[tuple[tuple[Action, ...], ...], ...]:
    """Run each device's plan as early as dependencies allow: per tick at
    most its next forward (inputs arrived, fewer than `in_flight` stashed),
    then the first of its backwards whose inputs are there."""
    G = p * v
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, global chunk) -> tick
    fwd = [deque(plan.forwards) for plan in plans]
    bwd = [list(plan.backwards) for plan in plans]
    live = [0] * p
    table = []
    limit = 4 * sum(len(plan.forwards) + len(plan.backwards) for plan in plans) + 10
    while any(fwd) or any(bwd):
        t = len(table)
        row = []
        for d, plan in enumerate(plans):
            acts = []
            a = fwd[d][0] if fwd[d] else None
            if a is not None and live[d] < plan.in_flight:
                g = a.chunk * p + d
                if g == 0 or done.get(("F", a.mb, g - 1), t) < t:
                    acts.append(fwd[d].popleft())
                    live[d] += 1
                    done[("F", a.mb, g)] = t
            if not (plan.after_forwards and fwd[d]):
                for i, b in enumerate(bwd[d]):
                    g = b.chunk * p + d
                    grad = (("F", b.mb, g) if g == G - 1 else ("B", b.mb, g + 1))
                    own_f = done.get(("F", b.mb, g), t + 1) <= t
                    arrived = done.get(grad, t + 1) <= t if g == G - 1 else done.get(grad, t) < t
                    if own_f and arrived:
                        acts.append(bwd[d].pop(i))
                        live[d] -= 1
                        done[("B", b.mb, g)] = t
                        break
            row.append(tuple(acts))
        table.append(tuple(row))
        if t > limit:
            raise RuntimeError("schedule does not complete: its plan has a cycle")
    return tuple(table)


def _place_ws(table, p: int, v: int, defer: list[int]):
    """The table with a W after each B, placed where it lengthens no tick.

    Tick by tick: device d must run a W when more than `defer[d]` wait
    (that lengthens the tick); then every device with Ws waiting runs them
    as long as they fit in the tick's length (at most `W_PER_TICK`). A
    device takes first the W of the tick's own B, which then needs nothing
    kept (the loop runs the two as one backward, `whole_backward`), then
    the oldest waiting: so the Ws that wait are those deferred when the
    pipeline fills, and wait for the ticks where it drains. Ws still
    waiting at the end get ticks of their own."""
    def load(acts):
        return sum(_UNIT[a.kind] for a in acts)

    def take(d, acts):
        own = [a for a in acts if a.kind == "B"]
        if own and waiting[d][-1] == Action("W", own[0].mb, own[0].chunk):
            return waiting[d].pop()
        return waiting[d].popleft()

    waiting = [deque() for _ in range(p)]
    out = []
    for row in table:
        row = [list(acts) for acts in row]
        for d, acts in enumerate(row):
            waiting[d].extend(Action("W", a.mb, a.chunk) for a in acts if a.kind == "B")
        for d, acts in enumerate(row):
            if len(waiting[d]) > defer[d]:
                acts.append(take(d, acts))
        length = max(map(load, row))
        for d, acts in enumerate(row):
            while (waiting[d] and sum(a.kind == "W" for a in acts) < W_PER_TICK
                   and load(acts) + _UNIT["W"] <= length):
                acts.append(take(d, acts))
        out.append(tuple(map(tuple, row)))
    while any(waiting):
        out.append(tuple(tuple(waiting[d].popleft() for _ in range(min(W_PER_TICK, len(waiting[d]))))
                         for d in range(p)))
    return tuple(out)


def whole_backward(actions: Sequence[Action]) -> bool:
    """Whether a device's actions in a tick hold a B and its own W: the
    loop then runs them as one backward, the weights' gradients with the
    input's, and keeps nothing for a later W."""
    bs = [a for a in actions if a.kind == "B"]
    return bool(bs) and Action("W", bs[0].mb, bs[0].chunk) in actions
