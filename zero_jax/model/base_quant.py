"""LoRA's frozen base stored quantized (QLoRA, Dettmers et al. 2023):
codes and float32 scales in place of each block projection's weight,
dequantized at use, inside the layer, in its compute layout.

The blocks run along a weight's first dimension as the layer sees it (the
layer stack's dimension aside), which every block projection contracts
over (models/common/layers.py `projection` checks):

- int8: symmetric, one scale (amax / 127) per column of that dimension:
  per output channel where it is the whole input (w_q, w_k, w_v, w_gate,
  w_up, w_down); w_o, whose input is (heads, head dim), has one per head
  dimension and output channel, over the heads.
- nf4: QLoRA's 4-bit NormalFloat, 16 levels at a normal distribution's
  quantiles scaled by each block's amax, blocks of `block` (64) elements
  of that dimension. QLoRA's second quantization of the scales is not
  done: they cost 32 / 64 = 0.5 bits per parameter, not 0.127.

Codes keep the weight's shape (int8; uint4, which XLA packs two a byte in
device memory), so ZeRO stores them as it would the weight, and the
rules lay them out as it; a scale's dimension keeps the weight's logical
name where the mesh divides it (`names`). At ZeRO-3 codes and scales are
gathered as they are stored (param_use pins them to their stored layout
first), then dequantized: XLA:CPU widens uint4 to int8 for the gather.
Only the block projections are quantized (embeddings, head and norms are
kept in the compute dtype, as QLoRA keeps them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zero_jax.model import lora, param_use
from zero_jax.model.lora import TARGETS

KINDS = ("none", "int8", "nf4")  # --lora-quantize-base (config/sections.py's Literal)
LEVELS = 127  # int8, symmetric: -127..127
# QLoRA's NF4 levels (bitsandbytes' create_normal_map): a normal's quantiles, scaled to [-1, 1].
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
_WEIGHTS = frozenset(TARGETS.values())  # the block projections: what is quantized


@dataclasses.dataclass(frozen=True)
class Format:
    """How a weight's codes read: its kind, the dimension the blocks run
    along (negative: counted from the end, so that it holds for a layer
    of a stacked weight too), and a block's length."""

    kind: str  # int8 | nf4
    dim: int
    block: int

    @property
    def code_dtype(self):
        return jnp.dtype(jnp.int8 if self.kind == "int8" else jnp.uint4)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        d = self.dim % len(shape)
        return (*shape[:d], shape[d] // self.block, *shape[d + 1:])


@jax.tree_util.register_pytree_node_class
class Quantized:
    """A weight as codes and scales (`Format`). Flattens codes first: a
    module checks the shape of the first leaf of what it is given as a
    parameter, and codes have the weight's shape."""

    def __init__(self, codes, scale, fmt: Format):
        self.codes, self.scale, self.fmt = codes, scale, fmt

    def tree_flatten(self):
        return (self.codes, self.scale), self.fmt

    @classmethod
    def tree_unflatten(cls, fmt, leaves):
        return cls(*leaves, fmt)


def format_of(kind: str, shape: tuple[int, ...], names, block: int) -> Format | None:
    """The Format a frozen weight of `shape` and logical `names` is stored
    in under `kind` (None: kept as it is)."""
    if kind == "none":
        return None
    lead = sum(1 for n in names if n == "layers")  # a stack's layer dimensions lead
    if len(shape) - lead < 2:
        return None
    n = shape[lead]
    size = n if kind == "int8" else max(b for b in range(1, min(block, n) + 1) if n % b == 0)
    return Format(kind, lead - len(shape), size)


def _quantizes(path) -> bool:
    key = path[-1]
    return str(getattr(key, "key", getattr(key, "name", key))) in _WEIGHTS


def abstract(base: Any, names: Any, kind: str, block: int) -> tuple[Any, Any]:
    """(the base's abstract tree, its logical names) with each block
    projection's weight a Quantized of codes and scales."""
    def one(path, a, n):
        fmt = format_of(kind, a.shape, tuple(n), block) if _quantizes(path) else None
        if fmt is None:
            return a, n
        scale = jax.ShapeDtypeStruct(fmt.scale_shape(a.shape), jnp.float32)
        return (Quantized(jax.ShapeDtypeStruct(a.shape, fmt.code_dtype), scale, fmt),
                Quantized(n, n, fmt))
    pairs = jax.tree_util.tree_map_with_path(one, base, names, is_leaf=_is_names)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and not isinstance(x, PartitionSpec)
    return (jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
            jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair))


def _is_names(x) -> bool:
    return isinstance(x, PartitionSpec)


def names(fmt: Format, weight_names, shape: tuple[int, ...], rules, sizes) -> PartitionSpec:
    """A scale's logical names: the weight's, but unnamed along the
    blocks' dimension where the mesh axes its name maps to do not divide
    the scale there (so that the rules, which refuse a split that does
    not divide, lay the scale out beside its codes where they can).
    `sizes` {}: no mesh."""
    if not sizes:
        return PartitionSpec(*weight_names)
    d = fmt.dim % len(shape)
    count = shape[d] // fmt.block
    n = weight_names[d]
    split = math.prod(sizes.get(a, 1) for a in rules.mesh_axes(n)) if n else 1
    kept = n if count % split == 0 else None
    return PartitionSpec(*weight_names[:d], kept, *weight_names[d + 1:])


def scale_names(names_tree: Any, abstract_tree: Any, rules, sizes) -> Any:
    """`names_tree` (from `abstract`) with each Quantized's scale named by `names`."""
    def one(n, a):
        if not isinstance(n, Quantized):
            return n
        return Quantized(n.codes, names(a.fmt, tuple(n.codes), a.codes.shape, rules, sizes), n.fmt)
    return jax.tree.map(one, names_tree, abstract_tree, is_leaf=_is_quantized_or_names)


def _is_quantized_or_names(x) -> bool:
    return isinstance(x, (Quantized, PartitionSpec))


def full(tree: Any) -> Any:
    """A tree of Quantized (abstract values, names, specs) with each one's
    codes in its place: the base as it is read, before quantization."""
    return jax.tree.map(lambda x: x.codes if isinstance(x, Quantized) else x, tree,
                        is_leaf=lambda x: isinstance(x, Quantized))


def _blocks(x: jax.Array, fmt: Format) -> jax.Array:
    """x with the blocks' dimension split in two: (..., count, block, ...)."""
    d = fmt.dim % x.ndim
    return x.reshape(*x.shape[:d], x.shape[d] // fmt.block, fmt.block, *x.shape[d + 1:])


def quantize(w: jax.Array, fmt: Format) -> Quantized:
    """w's codes and scales (computed in float32)."""
    d = fmt.dim % w.ndim
    x = _blocks(w.astype(jnp.float32), fmt)
    amax = jnp.max(jnp.abs(x), axis=d + 1, keepdims=True)
    if fmt.kind == "int8":
        scale = jnp.where(amax > 0, amax / LEVELS, 1.0)
        codes = jnp.clip(jnp.round(x / scale), -LEVELS, LEVELS)
    else:  # the nearest level: its index among the midpoints between levels
        scale = jnp.where(amax > 0, amax, 1.0)
        levels = jnp.asarray(NF4, jnp.float32)
        codes = jnp.searchsorted((levels[1:] + levels[:-1]) / 2, x / scale)
    return Quantized(codes.astype(fmt.code_dtype).reshape(w.shape), jnp.squeeze(scale, d + 1), fmt)


def dequantize(codes: jax.Array, scale: jax.Array, fmt: Format, dtype) -> jax.Array:
    """The weight the codes and scales stand for, in `dtype`."""
    d = fmt.dim % codes.ndim
    c = _blocks(codes, fmt)
    values = (c.astype(jnp.float32) if fmt.kind == "int8"
              else jnp.take(jnp.asarray(NF4, jnp.float32), c.astype(jnp.int32)))
    return (values * jnp.expand_dims(scale, d + 1)).reshape(codes.shape).astype(dtype)


def store(abstract_tree: Any, base: Any) -> Any:
    """The base's weights (a tree shaped as `full(abstract_tree)`) as the
    frozen base stores them: quantized where `abstract_tree` says, else
    cast to its dtype. Traceable."""
    def one(a, x):
        return quantize(x, a.fmt) if isinstance(a, Quantized) else x.astype(a.dtype)
    return jax.tree.map(one, abstract_tree, base, is_leaf=lambda x: isinstance(x, Quantized))


def split_base(names: Any, params: Any, compute_dtype, adapters: lora.Lora | None, rules,
               sizes: dict) -> tuple[Any, Any, Any, Any]:
    """(names, params, frozen names, frozen base) of a model's abstract
    tree: under LoRA the state's parameters are the adapters, and the rest
    is the frozen base, stored in the dtype it is used in (it is never
    updated), its block projections quantized where [lora] quantize_base
    asks; else the base is None."""
    if not lora.has_adapters(names):
        return names, params, None, None
    (names, frozen_names), (params, frozen) = lora.split(names), lora.split(params)
    frozen = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, compute_dtype), frozen)
    if adapters is not None and adapters.quantize_base != "none":
        frozen, frozen_names = abstract(frozen, frozen_names, adapters.quantize_base,
                                        adapters.base_block)
        frozen_names = scale_names(frozen_names, frozen, rules, sizes)
    return names, params, frozen_names, frozen


# --- frozen_dense: a product with a quantized frozen weight --------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def frozen_dense(uses: tuple, eq: str, fmt: Format, dtype, x, codes, scale):
    """einsum(eq, x, w) of LoRA's frozen weight w stored as codes and
    scales, `uses` theirs (param_use.Use): both gathered as they are stored,
    w dequantized into `dtype` in its compute layout. Backward gives x's
    gradient only (w is frozen), gathering and dequantizing again rather
    than keeping w."""
    return jnp.einsum(eq, x, _dequantized(uses, fmt, dtype, codes, scale))


def _dequantized(uses, fmt, dtype, codes, scale):
    return dequantize(uses[0].gather(codes), uses[1].gather(scale), fmt, dtype)


def _frozen_fwd(uses, eq, fmt, dtype, x, codes, scale):
    # x's dtype, as a zero-size stand-in: its gradient's
    return frozen_dense(uses, eq, fmt, dtype, x, codes, scale), (codes, scale,
                                                               jnp.zeros((0,), x.dtype))


def _frozen_bwd(uses, eq, fmt, dtype, res, g):
    codes, scale, like = res
    xs, ws, ys = param_use.operands(eq)
    w = _dequantized(uses, fmt, dtype, codes, scale)
    return jnp.einsum(f"{ys},{ws}->{xs}", g, w).astype(like.dtype), None, None


frozen_dense.defvjp(_frozen_fwd, _frozen_bwd)
