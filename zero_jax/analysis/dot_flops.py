"""Matrix-product FLOPs of a compiled program, read from its HLO.

A dot's FLOPs are 2 x its output's elements x its contracted size; each is
counted once per run of the computation it sits in (a fusion's, a loop
body's: traffic.multiplicities). XLA's own cost analysis counts a loop
body once whatever its trip count, so a layer scan's or a tiled grouped
GEMM's products are undercounted there. A loop whose trip count depends on
the data (the tiled grouped GEMM's, zero_jax/model/grouped.py) runs
`unknown_trips` times: the caller says how many, from the counts the loop
was given.
"""

from __future__ import annotations

import math
import re

from zero_jax.analysis import hlo
from zero_jax.analysis import traffic

_DOT = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[(?P<out>[\d,]*)\]\S*\s+dot\("
                  r"%?(?P<lhs>[\w.\-]+)")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*\w+\[(?P<dims>[\d,]*)\]")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _computation_flops(lines: list[str]) -> int:
    """FLOPs of the dots in one computation's lines, run once."""
    shapes = {m.group("name"): _dims(m.group("dims")) for line in lines if (m := _DEF.match(line))}
    total = 0
    for line in lines:
        m = _DOT.match(line)
        if m is None:
            continue
        lhs = shapes[m.group("lhs")]
        contracted = math.prod(lhs[d] for d in _dims(_CONTRACT.search(line).group(1)))
        total += 2 * math.prod(_dims(m.group("out"))) * contracted
    return total


def dot_flops(hlo_text: str, unknown_trips: int = 1) -> int:
    """FLOPs of every dot the program runs per call, loops of unknown trip
    count run `unknown_trips` times."""
    bodies, _ = hlo.computations(hlo_text)
    times, _, _ = traffic.multiplicities(hlo_text, unknown_trips)
    return sum(n * _computation_flops(bodies[name]) for name, n in times.items() if n)
