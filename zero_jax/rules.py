"""Logical axis names -> mesh axes -> PartitionSpecs.

Models name the dimensions of their parameters and activations with logical
names only (`embed`, `heads`, `mlp`, ...). An `AxisRules` object maps each
name to zero or more mesh axes; presets are plain data. The rules give the
*compute* layout (tensor parallelism, the batch split); which arrays are also
stored sharded over the data-parallel axes is ZeRO's choice (see zero.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec

from zero_jax.mesh import DATA_AXES

# Logical names every model may use. Parameters: embed, heads, kv (head size),
# mlp, vocab, pos (position table), layers (the scanned stack). Activations:
# batch, seq (inside a block), res_seq (the residual stream between blocks,
# split only under sequence parallelism), and the parameter names above.
LOGICAL_AXES: tuple[str, ...] = (
    "batch", "seq", "res_seq", "embed", "heads", "kv", "mlp", "vocab", "pos", "layers")


class ShardingError(ValueError):
    """A logical layout that cannot be placed on the mesh."""


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> tuple of mesh axes (empty: not split)."""

    name: str  # preset name, shown in the plan
    rules: tuple[tuple[str, tuple[str, ...]], ...]  # (logical, mesh axes) pairs

    def __post_init__(self):
        seen = set()
        for logical, _ in self.rules:
            if logical in seen:
                raise ShardingError(f"rules {self.name}: logical axis {logical!r} mapped twice")
            seen.add(logical)

    @property
    def table(self) -> Mapping[str, tuple[str, ...]]:
        return dict(self.rules)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        table = self.table
        if logical not in table:
            raise ShardingError(
                f"rules {self.name}: no rule for logical axis {logical!r}; known: "
                f"{', '.join(table)}. Add it to the rules (an empty tuple keeps it unsplit)")
        return table[logical]

    def spec(self, names: Sequence[str | None], shape: Sequence[int],
             mesh_sizes: Mapping[str, int], *, what: str = "array") -> PartitionSpec:
        """PartitionSpec of an array whose dimensions carry `names`.

        Mesh axes of size 1 are left out, so specs read the same on any mesh
        where they have no effect. Raises if one mesh axis would split two
        dimensions, or if a dimension is not divisible by its mesh axes.
        """
        if len(names) != len(shape):
            raise ShardingError(f"{what}: {len(names)} logical names {tuple(names)} for "
                                f"{len(shape)} dimensions {tuple(shape)}")
        used: dict[str, int] = {}
        entries = []
        for dim, (logical, size) in enumerate(zip(names, shape)):
            axes = tuple(a for a in self.mesh_axes(logical) if mesh_sizes.get(a, 1) > 1)
            for axis in axes:
                if axis in used:
                    raise ShardingError(
                        f"{what}: logical axes {names[used[axis]]!r} (dim {used[axis]}) and "
                        f"{logical!r} (dim {dim}) both map to mesh axis {axis!r} under rules "
                        f"{self.name}; map one of them elsewhere")
                used[axis] = dim
            split = math.prod(mesh_sizes[a] for a in axes)
            if size % split:
                sizes = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
                raise ShardingError(
                    f"{what}: dimension {dim} ({logical!r}) has size {size}, not divisible by "
                    f"mesh axes {sizes} = {split}; choose a size that {split} divides, or a "
                    f"mesh where {'/'.join(axes)} divides {size}")
            entries.append(axes[0] if len(axes) == 1 else (axes or None))
        return PartitionSpec(*entries)


def _rules(name: str, **table: tuple[str, ...]) -> AxisRules:
    return AxisRules(name, tuple((k, tuple(v)) for k, v in table.items()))


_UNSPLIT = {a: () for a in LOGICAL_AXES}

# Megatron-style tensor parallelism lives on the `tensor` axis: heads and the
# MLP hidden dimension are split (column-parallel in, row-parallel out), and
# the vocabulary too. On a mesh with tensor=1 these entries change nothing.
PRESETS: dict[str, AxisRules] = {
    "default": _rules("default", **{**_UNSPLIT, "batch": DATA_AXES,
                                    "heads": ("tensor",), "mlp": ("tensor",),
                                    "vocab": ("tensor",)}),
}


def preset(name: str) -> AxisRules:
    if name not in PRESETS:
        raise ShardingError(f"unknown rules preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
