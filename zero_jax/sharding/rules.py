"""Logical axis names -> mesh axes -> PartitionSpecs.

Models name the dimensions of their parameters and activations with logical
names only (`embed`, `heads`, `mlp`, ...). An `AxisRules` object maps each
name to zero or more mesh axes; presets are plain data. The rules give the
*compute* layout (tensor and sequence parallelism, the batch split); which
arrays are also stored sharded over the data-parallel axes is ZeRO's choice
(see zero.py). The named layouts a run chooses with `--layout` (`PRESETS`)
are data: rules plus a default stage.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec

from zero_jax.sharding.mesh import DATA_AXES

# Logical names every model may use. Parameters: embed, heads, kv_heads (key
# and value heads under grouped-query attention), kv (head size), mlp, vocab,
# pos (position table), layers (the scanned stack), experts (a mixture of
# experts' stacked experts). Activations: batch, seq
# (inside a block), res_seq (the residual stream between blocks, split only
# under sequence parallelism), and the parameter names above.
LOGICAL_AXES: tuple[str, ...] = (
    "batch", "seq", "res_seq", "embed", "heads", "kv_heads", "kv", "mlp", "vocab", "pos",
    "layers", "experts")


# How to make a dimension divisible, by logical name.
_FIXES = {
    "vocab": "pad the vocabulary to a multiple of {split} with --vocab-multiple "
             "(128 is customary; padded logits are masked)",
    "heads": "choose a number of heads divisible by {split}",
    "mlp": "choose an MLP width divisible by {split}",
    "batch": "choose a batch size divisible by {split}",
    "experts": "choose a number of experts divisible by {split}",
}


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

    def replace(self, **table: tuple[str, ...]) -> "AxisRules":
        """These rules with the given logical names mapped anew."""
        merged = {**self.table, **{k: tuple(v) for k, v in table.items()}}
        return AxisRules(self.name, tuple(merged.items()))

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
                fix = _FIXES.get(logical, "choose a size that {split} divides").format(split=split)
                raise ShardingError(
                    f"{what}: dimension {dim} ({logical!r}) has size {size}, not divisible by "
                    f"mesh axes {sizes} = {split}; {fix}, or a mesh where "
                    f"{'/'.join(axes)} divides {size}")
            entries.append(axes[0] if len(axes) == 1 else (axes or None))
        return PartitionSpec(*entries)


def _rules(name: str, **table: tuple[str, ...]) -> AxisRules:
    return AxisRules(name, tuple((k, tuple(v)) for k, v in table.items()))


# The scanned layer stack is split into contiguous stages over `pipe` (a
# no-op on meshes without it).
# A mixture of experts' stacked experts are split over `expert`.
# Context parallelism splits the sequence of every activation over `context`.
_DATA = {**{a: () for a in LOGICAL_AXES}, "batch": DATA_AXES, "layers": ("pipe",),
         "experts": ("expert",), "seq": ("context",), "res_seq": ("context",)}
# Megatron tensor parallelism on the `tensor` axis: attention heads and the MLP
# hidden dimension split (column-parallel in, row-parallel out), and the
# vocabulary split for the embedding and the logits.
_TENSOR = {"heads": ("tensor",), "kv_heads": ("tensor",), "mlp": ("tensor",),
           "vocab": ("tensor",)}
# Sequence parallelism: the residual stream between blocks (LayerNorm input,
# residual adds) split along the sequence over `tensor` as well.
_SEQUENCE = {"res_seq": ("context", "tensor")}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named parallel layout (`--layout`): axis rules and the ZeRO stage it
    implies. (Where the train state lives on a mesh is train/state.py's StatePlan.)"""

    rules: AxisRules
    zero_stage: int  # used when the run does not set one


# DP, FSDP and TP are different values of the same rules; ZeRO (zero.py)
# decides which states are also split over the data-parallel axes.
PRESETS: dict[str, Preset] = {
    "dp": Preset(_rules("dp", **_DATA), 0),
    "fsdp": Preset(_rules("fsdp", **_DATA), 3),
    "fsdp_tp": Preset(_rules("fsdp_tp", **{**_DATA, **_TENSOR}), 3),
    "fsdp_tp_sp": Preset(_rules("fsdp_tp_sp", **{**_DATA, **_TENSOR, **_SEQUENCE}), 3),
}


def preset(name: str, mesh_sizes: Mapping[str, int]) -> Preset:
    """A layout preset by name (the config checks the name); "auto" is fsdp, or
    fsdp_tp when the mesh has a tensor axis."""
    if name == "auto":
        name = "fsdp_tp" if mesh_sizes.get("tensor", 1) > 1 else "fsdp"
    chosen = PRESETS[name]
    used = {a for axes in chosen.rules.table.values() for a in axes}
    if mesh_sizes.get("tensor", 1) > 1 and "tensor" not in used:
        raise ShardingError(
            f"layout {name} splits nothing over the mesh's tensor={mesh_sizes['tensor']} axis, "
            "so those devices would only repeat each other's work; use --layout fsdp_tp "
            "(or fsdp_tp_sp), or a mesh without a tensor axis")
    return chosen
