"""ZeRO: which model states are stored sharded over the data-parallel axes.

    | stage | optimizer state | gradients              | parameters                 |
    |-------|-----------------|------------------------|----------------------------|
    | 0     | replicated      | replicated, all-reduce | replicated (DDP)           |
    | 1     | sharded         | replicated, all-reduce | replicated                 |
    | 2     | sharded         | sharded, reduce-scatter| replicated                 |
    | 3     | sharded         | sharded, reduce-scatter| sharded, all-gather at use |

"Sharded" means: on top of the compute layout the rules give (tensor
parallelism), one dimension of the array is split over the ZeRO axes
(`MeshShape.shard_axes`: every data-parallel axis, or only the ones a mesh
config names, which is hybrid sharding). Which dimension follows one rule,
`zero_dim`. The collectives then follow from the layouts: jit inserts them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import optax
from jax.sharding import PartitionSpec

from zero_jax.sharding.mesh import MeshShape
from zero_jax.sharding.specs import entries, entry_axes, map_specs, path_name


@dataclasses.dataclass(frozen=True)
class ZeroStage:
    """One row of the table above."""

    opt_state: bool  # optimizer state stored sharded
    grads: bool  # gradients stored (and accumulated) sharded
    params: bool  # parameters stored sharded, gathered for use


STAGES: dict[int, ZeroStage] = {
    0: ZeroStage(opt_state=False, grads=False, params=False),
    1: ZeroStage(opt_state=True, grads=False, params=False),
    2: ZeroStage(opt_state=True, grads=True, params=False),
    3: ZeroStage(opt_state=True, grads=True, params=True),
}

# Never split over the ZeRO axes: the scan over layers takes one slice of the
# stacked parameters per iteration, and a stack split along `layers` would be
# gathered whole at every step of the loop.
UNSHARDABLE_LOGICAL = frozenset({"layers"})


def stage(n: int) -> ZeroStage:
    if n not in STAGES:
        raise ValueError(f"--zero-stage {n!r}: choose 0 (DDP), 1 (optimizer state), "
                         "2 (+ gradients) or 3 (+ parameters)")
    return STAGES[n]


def zero_dim(shape: Sequence[int], spec: PartitionSpec, names: Sequence[str | None] | None,
             n_shard: int, min_elements: int) -> tuple[int | None, str]:
    """The dimension that takes the ZeRO axes, or None and the reason why not.

    The rule: arrays under `min_elements` elements per layer stay replicated
    (their collectives cost more than they save); otherwise take the largest
    dimension that no mesh axis splits yet, that is not a scanned `layers`
    dimension, and that `n_shard` divides; among equal sizes, the first.
    Counting per layer makes the decision the same for a stacked array and
    for the one-layer slice a scanned model uses, which is what `Hooks` sees.
    """
    if n_shard == 1:
        return None, "no ZeRO axes in this mesh"
    size = math.prod(n for d, n in enumerate(shape)
                     if not (names and names[d] in UNSHARDABLE_LOGICAL))
    if size < min_elements:
        return None, f"{size} elements per layer < min_shard_elements={min_elements}"
    spec = entries(spec, len(shape))
    free = [d for d in range(len(shape))
            if spec[d] is None and not (names and names[d] in UNSHARDABLE_LOGICAL)]
    fits = [d for d in free if shape[d] % n_shard == 0]
    if not fits:
        dims = ", ".join(f"{d}:{shape[d]}" for d in free) or "none free"
        return None, f"no free dimension divisible by {n_shard} (free dims {dims})"
    return min(fits, key=lambda d: (-shape[d], d)), ""


def with_zero(spec: PartitionSpec, dim: int | None, ndim: int,
              shard_axes: tuple[str, ...]) -> PartitionSpec:
    """`spec` with the ZeRO axes added on dimension `dim` (None: unchanged)."""
    if dim is None:
        return spec
    dims = entries(spec, ndim)
    dims[dim] = shard_axes[0] if len(shard_axes) == 1 else tuple(shard_axes)
    return PartitionSpec(*dims)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The ZeRO split on one mesh: axes, their total size, and the size floor."""

    axes: tuple[str, ...]  # the ZeRO axes (MeshShape.shard_axes)
    n_shard: int  # product of their sizes
    min_elements: int  # arrays smaller than this per layer stay whole
    sizes: tuple[int, ...] = ()  # each axis's size (default: one axis of n_shard)

    @classmethod
    def on(cls, mesh: MeshShape, min_elements: int) -> "Placement":
        axes = mesh.shard_axes
        return cls(axes, math.prod(mesh.sizes[a] for a in axes), min_elements,
                   tuple(mesh.sizes[a] for a in axes))

    def axes_for(self, spec: PartitionSpec) -> tuple[tuple[str, ...], int]:
        """The ZeRO axes an array laid out by `spec` can take, and their
        size: those its compute layout does not use already. An expert's
        weights, split over `expert`, are sharded over the other data axes
        only: DeepSpeed-MoE's expert-data-parallel group."""
        used = {a for e in spec for a in entry_axes(e)}
        sizes = self.sizes or (self.n_shard,)
        kept = [(a, n) for a, n in zip(self.axes, sizes) if a not in used]
        return tuple(a for a, _ in kept), math.prod(n for _, n in kept)

    def dim(self, shape, spec: PartitionSpec, names=None) -> tuple[int | None, str]:
        return zero_dim(shape, spec, names, self.axes_for(spec)[1], self.min_elements)

    def spec(self, shape, spec: PartitionSpec, names=None) -> PartitionSpec:
        """`spec` plus the ZeRO split where the rule allows it."""
        return with_zero(spec, self.dim(shape, spec, names)[0], len(shape),
                         self.axes_for(spec)[0])


@dataclasses.dataclass(frozen=True)
class StateSpecs:
    """PartitionSpecs of every model state, for one stage on one mesh."""

    compute: Any  # params tree: layout for use in the forward/backward (rules only)
    sharded: Any  # params tree: compute layout plus the ZeRO split, where the rule allows
    params: Any  # params tree: storage layout of the parameters
    grads: Any  # params tree: layout gradients are reduced and accumulated in
    opt_state: Any  # optimizer-state tree
    replicated: tuple[tuple[str, str], ...]  # (path, reason) of arrays ZeRO left whole


def layer_stacks(names: Any) -> Any:
    """Per parameter, whether it is a layer stack: its first logical axis is
    `layers` (`names`: a tree of logical-name PartitionSpecs)."""
    return map_specs(lambda n: len(n) > 0 and n[0] == "layers", names)


def state_specs(abstract_params: Any, compute_specs: Any, names: Any, abstract_opt_state: Any,
                tx: optax.GradientTransformation, zero: ZeroStage, placement: Placement,
                over_pipe: PipeSplit | None = None) -> StateSpecs:
    """Storage specs of params, grads and optimizer state for one ZeRO stage.

    Optimizer-state leaves that mirror a parameter (Adam's moments, momentum)
    take that parameter's layout; the others (counts, factored second moments)
    are placed by the same `zero_dim` rule on their own shapes.

    With a pipeline (`over_pipe`), the parameters outside the layer stack
    (those not `layer_stacks`: the embedding, head, final norm) are also
    stored split over `pipe` (`PipeSplit`). Training gathers them once per
    step for the first and last stage.
    """
    over_pipe = over_pipe or PipeSplit(None, None)
    stacked = layer_stacks(names) if over_pipe.stacked is None else over_pipe.stacked
    outer = (jax.tree.map(lambda _: False, abstract_params) if over_pipe.pipe is None
             else jax.tree.map(lambda st: not st, stacked))
    replicated: list[tuple[str, str]] = []

    def sharded(path, leaf, spec, leaf_names, is_outer):
        dim, why = placement.dim(leaf.shape, spec, leaf_names)
        if dim is None and placement.n_shard > 1:
            replicated.append((path_name(path), why))
        return over_pipe(leaf, with_zero(spec, dim, len(leaf.shape), placement.axes_for(spec)[0]),
                         leaf_names, is_outer)

    full = jax.tree_util.tree_map_with_path(sharded, abstract_params, compute_specs, names, outer)
    stored = jax.tree.map(over_pipe, abstract_params, compute_specs, names, outer)
    opt = _opt_state_specs(tx, abstract_opt_state, abstract_params, full, stored, zero, placement)
    return StateSpecs(
        compute=compute_specs,
        sharded=full,
        params=full if zero.params else stored,
        grads=full if zero.grads else stored,
        opt_state=opt,
        replicated=tuple(replicated))


def stored_specs(abstract_params: Any, compute_specs: Any, names: Any, zero: ZeroStage,
                 placement: Placement) -> Any:
    """Storage specs of parameters that have no gradient and no optimizer
    state (LoRA's frozen base): split as `state_specs` stores parameters,
    over the ZeRO axes at stage 3, whole in their compute layout below it."""
    return state_specs(abstract_params, compute_specs, names, optax.EmptyState(),
                       optax.identity(), zero, placement).params


def _opt_state_specs(tx: optax.GradientTransformation, abstract_opt_state: Any,
                     abstract_params: Any, full: Any, stored: Any, zero: ZeroStage,
                     placement: Placement) -> Any:
    """Specs of the optimizer state: a leaf shaped like its parameter takes the
    parameter's sharded layout (stored, when the stage leaves the state
    whole); any other leaf is split by `placement`'s rule on its own shape."""

    def other(leaf):
        if not zero.opt_state:
            return PartitionSpec()
        return placement.spec(getattr(leaf, "shape", ()), PartitionSpec())

    def mirror(leaf, param, full_spec, stored_spec):
        if leaf.shape == param.shape:
            return full_spec if zero.opt_state else stored_spec
        return other(leaf)

    return optax.tree_map_params(tx, mirror, abstract_opt_state, abstract_params, full, stored,
                                 transform_non_params=other, is_leaf=_is_abstract)


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


@dataclasses.dataclass(frozen=True)
class PipeSplit:
    """Where a pipeline stores a parameter outside the layer stack, split over
    `pipe`: a table (two or more dimensions) by its rows, `pipe` first, where
    `pipe` times the axes already there divides them, so that each stage
    holds a contiguous block of the vocabulary and evaluation can look rows
    up and compute logits where they are stored (pipeline/executor.py `loss`);
    otherwise by the same rule as ZeRO, or along a dimension already split
    where none is free. Without a pipeline (`pipe` None) nothing changes."""

    pipe: Placement | None
    axis_sizes: dict[str, int] | None  # the mesh's axis sizes
    # The leaves in the pipeline's cut (a tree of bools; None: every layer
    # stack). A stack outside it (dense layers before a mixture's, which the
    # first stage runs) is stored as the outer parameters are.
    stacked: Any = None

    def __call__(self, leaf, spec: PartitionSpec, leaf_names, is_outer: bool) -> PartitionSpec:
        if not is_outer or self.pipe is None:
            return spec
        big = math.prod(leaf.shape) >= self.pipe.min_elements
        if big and (rows := _rows_first(leaf.shape, spec, "pipe", self.axis_sizes)) is not None:
            return rows
        dim, _ = self.pipe.dim(leaf.shape, spec, leaf_names)
        if dim is not None:
            return with_zero(spec, dim, len(leaf.shape), self.pipe.axes)
        if not big:
            return spec
        return _extend(leaf.shape, spec, "pipe", self.axis_sizes)


def _rows_first(shape, spec: PartitionSpec, axis: str,
                axis_sizes: dict[str, int] | None) -> PartitionSpec | None:
    """`spec` with mesh `axis` first on dimension 0 of a table (two or more
    dimensions), if its size times the axes already there divides the rows;
    else None."""
    if len(shape) < 2 or axis_sizes is None:
        return None
    dims = entries(spec, len(shape))
    there = entry_axes(dims[0])
    if shape[0] % (axis_sizes[axis] * math.prod(axis_sizes[a] for a in there)):
        return None
    dims[0] = (axis,) + there if there else axis
    return PartitionSpec(*dims)


def _extend(shape, spec: PartitionSpec, axis: str, axis_sizes: dict[str, int]) -> PartitionSpec:
    """`spec` with mesh `axis` added to a dimension that is already split,
    where its size divides by the product: the largest such dimension.
    Unchanged if none does."""
    dims = entries(spec, len(shape))
    for d in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        if dims[d] is None:
            continue
        axes = entry_axes(dims[d])
        if shape[d] % (axis_sizes[axis] * math.prod(axis_sizes[a] for a in axes)) == 0:
            dims[d] = axes + (axis,)
            return PartitionSpec(*dims)
    return spec
