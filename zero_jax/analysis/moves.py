"""What a compiled step moves without computing: its copies, transposes,
zero-fills, slices and in-place updates, per step, read from optimised HLO.

A step's arithmetic is what the model asks for; the rest of its memory
traffic is bookkeeping the compiler could not fold away: a transposing copy
so that a dot reads its operand in the layout it wants, a layer's slice of
a stacked buffer, the write of what the backward keeps into one, the zeros
a buffer starts as (a fill: any broadcast written out). This module counts
each such op once per execution (a loop body's ops times the loop's trip
count) with the bytes it writes.

An instruction is a move when it, or every op of the fusion it runs, only
rearranges or fills memory (MOVES; arithmetic on scalars, which indexes,
does not count). Its kind is the most telling op it holds (KINDS, first
wins); its bytes are what it writes: its result, or for an in-place
dynamic-update-slice the update.
"""

from __future__ import annotations

import dataclasses
import re

from zero_jax.analysis import hlo, traffic

# The kinds, most telling first, and the opcodes of each. A copy inside a
# fusion changes the layout (XLA removes the others): a transpose, which
# outranks the slice it is fused with. reduce-precision to a type's own
# precision changes nothing but is executed as a copy.
KINDS = {
    "dynamic-update-slice": ("dynamic-update-slice",),
    "transpose": ("transpose", "fused copy"),
    "dynamic-slice": ("dynamic-slice",),
    "copy": ("copy", "reduce-precision"),
    "slice, concatenate, pad": ("slice", "concatenate", "pad"),
    "fill": ("broadcast",),
}
# Opcodes that rearrange or fill memory without computing on it.
MOVES = {op for ops in KINDS.values() for op in ops if op != "fused copy"} | {
    "parameter", "constant", "bitcast", "reshape", "iota", "get-tuple-element", "tuple"}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s"
                 r"(?P<op>[a-z][\w\-]*)\((?P<args>.*?)\)(?:,|$)")
# Instructions that are not moves themselves: bookkeeping, and calls whose
# bodies are visited on their own (a fusion is judged by its body).
_SKIPPED = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
            "conditional"}


@dataclasses.dataclass(frozen=True)
class Move:
    kind: str  # a key of KINDS
    name: str  # the instruction (a fusion, or the op itself)
    type: str  # its result's HLO type, e.g. "f32[4,32,128,192]{3,2,1,0}"
    op_name: str  # the JAX operation it came from (its metadata), "" when none
    times: int  # executions per step
    bytes: int  # bytes written per execution


def _parse(line: str) -> dict[str, str] | None:
    m = _OP.match(line)
    return m.groupdict() if m else None


def _scalar(type_text: str) -> bool:
    return re.fullmatch(r"\(?[a-z]\w*\[\]\)?", type_text.strip()) is not None


def _kind(ops: set[str]) -> str | None:
    return next((kind for kind, members in KINDS.items() if members and set(members) & ops), None)


def _fusion_kind(body: list[str]) -> tuple[str | None, int | None]:
    """A fused computation's kind (None: it computes), and the bytes its
    in-place update writes (None: its result's)."""
    ops, update = set(), None
    types = {}
    for line in body:
        p = _parse(line)
        if p is None:
            continue
        types[p["name"]] = p["type"]
        if p["op"] not in MOVES and not _scalar(p["type"]):
            return None, None
        ops.add("fused copy" if p["op"] == "copy" and not _scalar(p["type"]) else p["op"])
        if p["op"] == "dynamic-update-slice":
            operand = p["args"].split(",")[1].strip().lstrip("%")
            update = sum(traffic.array_bytes(types.get(operand, "")))
    return _kind(ops), update


def census(hlo_text: str) -> list[Move]:
    """Every move the step executes, largest bytes per step first."""
    bodies, _ = hlo.computations(hlo_text)
    times, _, _ = traffic.multiplicities(hlo_text)
    fused = {c for lines in bodies.values() for line in lines if " fusion(" in line
             for c in hlo.callees(line, ("calls",))}
    moves = []
    for comp, n in times.items():
        if comp in fused:
            continue
        for line in bodies.get(comp, []):
            p = _parse(line)
            if p is None or p["op"] in _SKIPPED:
                continue
            update = None
            if p["op"] == "fusion":
                callee = hlo.callees(line, ("calls",))
                kind, update = _fusion_kind(bodies.get(callee[0], [])) if callee else (None, None)
            else:
                kind = _kind({p["op"]})
            if kind is None:
                continue
            size = update if update is not None else sum(traffic.array_bytes(p["type"]))
            op_name = re.search(r'op_name="([^"]*)"', line)
            moves.append(Move(kind, p["name"], p["type"], op_name.group(1) if op_name else "", n,
                              size))
    return sorted(moves, key=lambda m: -m.times * m.bytes)


def by_kind(moves: list[Move]) -> dict[str, tuple[int, int]]:
    """{kind: (executions per step, bytes per step)}, in KINDS' order."""
    out = {}
    for kind in KINDS:
        mine = [m for m in moves if m.kind == kind]
        if mine:
            out[kind] = (sum(m.times for m in mine), sum(m.times * m.bytes for m in mine))
    return out
