"""Why the actual shardings' bytes differ from the ZeRO formula's, leaf by leaf.

The formula (memory.theory) divides every parameter's states by the ZeRO
degree where the stage shards them and by the tensor degree t. The
shardings do otherwise in three ways, each of which this module prices:
an array split over an axis the formula does not count (a pipeline
stage's stacked layers over pipe: each stage stores its own), an array
tensor parallelism leaves whole (norms, biases, a table the rules do not
split), and an array ZeRO leaves whole (smaller than min_shard_elements,
or with no dimension the ZeRO axes divide).
"""

from __future__ import annotations

import math
from collections import defaultdict

from zero_jax.analysis import memory
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.specs import entry_axes, named_leaves, spec_leaves
from zero_jax.train.state import StatePlan


def _axes(spec) -> set[str]:
    return {a for entry in spec for a in entry_axes(entry)}


def _causes(extra: float, extra_axes: set[str], tensor: float, zero: float) -> list[tuple[str, float]]:
    """The factors by which a leaf's divisor differs from the formula's, one
    cause each: split over axes the formula does not count (x `extra`), left
    whole by tensor (/ `tensor`), left whole by ZeRO (/ `zero`)."""
    out = []
    if extra > 1:
        out.append(("split over " + "*".join(sorted(extra_axes)) + " as well"
                    + (", each pipeline stage storing its own layers" if "pipe" in extra_axes
                       else ""), extra))
    if tensor > 1:
        out.append(("not split over tensor", 1 / tensor))
    if zero > 1:
        out.append(("left whole by ZeRO", 1 / zero))
    return out


def gap(state_plan: StatePlan) -> list[tuple[str, float, int]]:
    """(cause, bytes per device the shardings hold beyond the formula, arrays)
    for each cause, largest first. A leaf's difference is taken one factor
    at a time (the extra axes, then tensor, then ZeRO), each step's bytes to
    its cause, so the parts sum to the whole; what is left, to "other"
    (uneven splits' padding, scalar optimizer leaves, optimizer leaves that
    mirror no parameter)."""
    stage = zero_lib.stage(state_plan.zero_stage)
    sizes = state_plan.mesh_shape.sizes
    zero_axes = {a for a in state_plan.mesh_shape.shard_axes if sizes[a] > 1}
    t, ep = sizes["tensor"], sizes.get("expert", 1)
    per = memory.bytes_per_param(state_plan)
    opt_specs = state_plan.specs.sharded if stage.opt_state else state_plan.specs.compute
    states = (("params", stage.params, state_plan.specs.params), ("grads", stage.grads, state_plan.specs.grads),
              ("opt_state", stage.opt_state, opt_specs))
    leaves = list(named_leaves(state_plan.abstract.params).values())
    names = spec_leaves(state_plan.names)
    by_cause: dict[str, float] = defaultdict(float)
    arrays: dict[str, set[int]] = defaultdict(set)
    for key, sharded, specs in states:
        for i, (leaf, name, spec) in enumerate(zip(leaves, names, spec_leaves(specs))):
            expert = "experts" in tuple(name)
            size = math.prod(leaf.shape) * per[key]
            formula = size / memory.divisor(state_plan, sharded, expert)
            formula_axes = ({"tensor"} if t > 1 else set()) | (zero_axes if sharded else set()) \
                | ({"expert"} if expert and ep > 1 else set())
            axes = {a for a in _axes(spec) if sizes[a] > 1}
            extra_axes = axes - formula_axes
            missing = formula_axes - axes
            held = formula
            for cause, factor in _causes(math.prod(sizes[a] for a in extra_axes), extra_axes,
                                         t if "tensor" in missing else 1,
                                         math.prod(sizes[a] for a in missing - {"tensor"})):
                by_cause[cause] += held / factor - held
                arrays[cause].add(i)
                held /= factor
    total = sum(memory.sharded(state_plan).values()) - sum(memory.theory(state_plan).values())
    rest = total - sum(by_cause.values())
    rows = sorted(((c, b, len(arrays[c])) for c, b in by_cause.items()), key=lambda r: -abs(r[1]))
    return rows + ([("other", rest, 0)] if abs(rest) >= 1024 else [])


def describe(state_plan: StatePlan) -> str | None:
    """One line: what makes the shardings' total differ from the formula's,
    in MiB per device; None where they agree within 0.5%."""
    rows = gap(state_plan)  # its parts sum to the whole difference, within a KiB
    if abs(sum(b for _, b, _ in rows)) <= 0.005 * sum(memory.theory(state_plan).values()):
        return None
    parts = [f"{b / 2**20:+.2f} MiB {cause}" + (f" ({n} array{'s' * (n > 1)})" if n else "")
             for cause, b, n in rows]
    return "why they differ: " + "; ".join(parts)
