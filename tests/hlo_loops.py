"""What of a compiled program runs inside its loops: the tests' view of
where a collective sits (per layer, per pipeline tick) against once a step."""

from __future__ import annotations

from zero_jax.analysis import hlo


def inside_loops(hlo_text: str) -> str:
    """The HLO of every computation reachable from a while loop's body: what
    runs once per iteration (e.g. per pipeline tick), not once per step."""
    bodies, _ = hlo.computations(hlo_text)
    todo = [c for lines in bodies.values() for line in lines for c in hlo.callees(line, ("body",))]
    seen: set[str] = set()
    while todo:
        c = todo.pop()
        if c not in seen and c in bodies:
            seen.add(c)
            todo += [callee for line in bodies[c] for callee in hlo.callees(line)]
    return "\n".join(line for c in seen for line in bodies[c])
