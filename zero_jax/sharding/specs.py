"""The small operations on PartitionSpecs and their trees that the memory
report, the planner, the ZeRO table, checkpoints and the pipeline all need,
named once.

A spec tree mirrors a parameter tree with one PartitionSpec per leaf; since a
PartitionSpec is itself a tuple, tree functions must be told it is a leaf
(`is_spec`). A spec entry is None (not split), one mesh axis, or a tuple of
them (`entry_axes`). A leaf's path is written dotted (`blocks.w_fc`), the
name checkpoint manifests, messages and exports use (`path_name`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def is_spec(x: Any) -> bool:
    """A leaf of a spec tree."""
    return isinstance(x, PartitionSpec)


def spec_leaves(specs: Any) -> list[PartitionSpec]:
    """The PartitionSpecs of a spec tree, in the order of its parameters."""
    return jax.tree.leaves(specs, is_leaf=is_spec)


def map_specs(fn: Callable[..., Any], specs: Any, *rest: Any) -> Any:
    """`jax.tree.map(fn, specs, *rest)` with each PartitionSpec one leaf."""
    return jax.tree.map(fn, specs, *rest, is_leaf=is_spec)


def entry_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one spec entry: None -> (), "a" -> ("a",), ("a", "b") -> itself."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entries(spec: PartitionSpec, ndim: int) -> list[str | tuple[str, ...] | None]:
    """One entry per dimension of an `ndim`-dimensional array (a spec may be shorter)."""
    return list(tuple(spec) + (None,) * (ndim - len(spec)))


def path_name(path: Iterable[Any]) -> str:
    """A key path as a dotted name: `blocks.w_fc`."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{dotted path: leaf} of a tree, in its order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {path_name(p): leaf for p, leaf in leaves}


def shard_elements(shape: tuple[int, ...], sharding: NamedSharding) -> int:
    """Elements of an array of `shape` that one device holds under `sharding`."""
    return math.prod(sharding.shard_shape(tuple(shape)))


def nbytes(elements: int, dtype) -> int:
    """Bytes `elements` of `dtype` take in device memory: 4-bit types
    (LoRA's NF4 base codes) are packed two a byte, which numpy's itemsize
    of 1 does not say."""
    dtype = np.dtype(dtype)
    bits = 4 if dtype.name in ("int4", "uint4") else 8 * dtype.itemsize
    return -(-elements * bits // 8)


def shard_bytes(leaf: Any, spec: PartitionSpec, mesh) -> int:
    """Bytes one device holds of `leaf` (an array or ShapeDtypeStruct) laid out by `spec`."""
    return nbytes(shard_elements(leaf.shape, NamedSharding(mesh, spec)), leaf.dtype)


def leaf_bytes(abstract: Any, specs: Any, mesh) -> list[int]:
    """`shard_bytes` of every leaf of `abstract` laid out by the spec tree `specs`."""
    return [shard_bytes(leaf, spec, mesh)
            for leaf, spec in zip(jax.tree.leaves(abstract), spec_leaves(specs))]


def bytes_per_device(abstract: Any, specs: Any, mesh) -> int:
    """Bytes one device holds of the tree `abstract` laid out by `specs`."""
    return sum(leaf_bytes(abstract, specs, mesh))


def without_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """`spec` with mesh `axis` removed wherever it appears."""
    def drop(entry):
        kept = tuple(a for a in entry_axes(entry) if a != axis)
        if isinstance(entry, str) or len(kept) <= 1:
            return kept[0] if kept else None
        return kept
    return PartitionSpec(*(drop(e) for e in spec))
