"""Collectives in compiled HLO text: which ones, how many, in what dtype.

Tests and reports read the optimised HLO (`compiled.as_text()`) to check
that a layout compiles to the communication it promises.
"""

from __future__ import annotations

import collections
import dataclasses
import re

OPS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

# `%name = <type> <op>(` where <type> may be a tuple with spaces in it; async
# pairs appear as `<op>-start` (counted) and `<op>-done` (not counted).
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s"
                   r"(?P<op>" + "|".join(OPS) + r")(?:-start)?\(")
_DTYPE = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*)\[")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # one of OPS
    dtypes: tuple[str, ...]  # element types in the result type
    line: str  # the HLO instruction, for messages


def collectives(hlo_text: str) -> list[Collective]:
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if m:
            out.append(Collective(m["op"], tuple(_DTYPE.findall(m["type"])), line.strip()))
    return out


def counts(hlo_text: str) -> dict[str, int]:
    """Number of instructions of each collective op (0 for absent ones)."""
    found = collections.Counter(c.op for c in collectives(hlo_text))
    return {op: found.get(op, 0) for op in OPS}
