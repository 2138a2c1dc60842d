"""ZeRO++'s quantized collectives (Wang et al. 2023): int8 with one float32
scale per block of a row, so an all-gather or a reduction moves about a
byte per element instead of two (bf16) or four (float32).

A block's scale maps its largest magnitude onto 127; values round to the
nearest integer, so each element is off by at most half a step of its
block, amax / 254. Blocks run along a row of contiguous elements no mesh
axis splits, so each device quantizes only what it holds:

- `blocks` picks the block: the configured size where it divides the row,
  else the largest divisor of the row down to half that size, else (rows
  shorter than a block) the whole row, else the row padded to whole blocks.
- `gather` (qwZ): a ZeRO-3 parameter, stored split on one dimension over
  the ZeRO axes, quantized where it is stored, all-gathered as int8 and its
  scales, and dequantized into its compute layout. Each device's shard
  becomes one entry of a leading axis over the ZeRO axes, so a block never
  straddles two devices.
- `reduce_scatter` (qgZ): per-device partial sums of a gradient, quantized
  in the blocks of the shards they are summed into, exchanged by an
  all-to-all over the ZeRO axes, dequantized and summed in float32.
- `wire_bytes`: what either moves, scales included (analysis/traffic.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax.config.sections import ConfigError, ZeroConfig
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.mesh import DATA_AXES
from zero_jax.sharding.specs import entries, entry_axes

LEVELS = 127  # int8, symmetric: -127..127
SCALE_BYTES = 4  # a float32 scale per block


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How a row splits into blocks."""

    size: int  # elements per block
    padded: int  # the row's length, padded to whole blocks

    def count(self) -> int:
        return self.padded // self.size


def blocks(row: int, block: int) -> Blocks:
    """The blocks of a row of `row` elements, of about `block` each."""
    if row <= block:
        return Blocks(row, row)
    for size in range(block, (block + 1) // 2 - 1, -1):
        if row % size == 0:
            return Blocks(size, row)
    return Blocks(block, -(-row // block) * block)


def wire_bytes(elements: int, row: int, block: int) -> float:
    """Bytes an int8 collective moves for `elements` laid out in rows of
    `row`: a byte per (padded) element and a scale per block."""
    b = blocks(row, block)
    rows = elements / row
    return rows * (b.padded + SCALE_BYTES * b.count())


def check(zero: ZeroConfig, zero_stage: int, pipelined: bool, grad_reduce: str,
          shard_axes: tuple[str, ...]) -> None:
    """qwZ and qgZ quantize ZeRO-3's collectives: refused below it; qgZ the
    reductions it runs inside the backward pass, which a pipeline, or
    gradients reduced once per step, leave to a reduction of partial sums,
    and which it can only make from each device's own rows of the batch:
    not where ZeRO shards over `context`, which splits the sequence.
    `grad_reduce` is --grad-reduce as given: "auto" reduces each
    microbatch at ZeRO-3."""
    unsplit = [a for a in shard_axes if a not in DATA_AXES]
    if zero.quantized_grads and zero_lib.stage(zero_stage).params and unsplit:
        raise ConfigError(
            f"--zero-quantized-grads with ZeRO over {','.join(unsplit)}: qgZ sums each "
            "device's partial gradient over its own rows of the batch, and that axis splits "
            "the sequence, not the batch; set zero_shard_axes to the data axes (hybrid "
            "sharding), or leave --zero-quantized-grads out")
    if zero.quantized_grads and zero_lib.stage(zero_stage).params and (
            pipelined or grad_reduce == "step"):
        why = "a pipeline" if pipelined else "--grad-reduce step"
        raise ConfigError(
            f"--zero-quantized-grads with {why}: qgZ quantizes the gradient reduction ZeRO-3 "
            "runs in the backward pass, layer by layer, and here gradients are summed per "
            "device and reduced once per step; leave --zero-quantized-grads out, or use "
            "--grad-reduce microbatch without a pipeline")
    if zero_lib.stage(zero_stage).params:
        return
    if zero.quantized_weights:
        raise ConfigError(
            f"--zero-quantized-weights with --zero-stage {zero_stage}: qwZ quantizes ZeRO-3's "
            "all-gather of the parameters, which stages 0-2 keep whole on each device; use "
            "--zero-stage 3, or leave it out")
    if zero.quantized_grads:
        raise ConfigError(
            f"--zero-quantized-grads with --zero-stage {zero_stage}: qgZ quantizes the reduction "
            "ZeRO-3 runs inside the backward pass, layer by layer; use --zero-stage 3, or leave "
            "it out")


def quantize(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x's last axis in blocks: (int8 (..., blocks, size), float32 scales
    (..., blocks, 1))."""
    b = blocks(x.shape[-1], block)
    x = x.astype(jnp.float32)
    if b.padded > x.shape[-1]:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, b.padded - x.shape[-1])])
    x = x.reshape(*x.shape[:-1], b.count(), b.size)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / LEVELS, 1.0)
    q = jnp.clip(jnp.round(x / scale), -LEVELS, LEVELS).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, row: int, dtype) -> jax.Array:
    """The rows of `quantize`'s blocks, in `dtype` (computed in float32)."""
    x = q.astype(jnp.float32) * scale
    return x.reshape(*x.shape[:-2], -1)[..., :row].astype(dtype)


@dataclasses.dataclass(frozen=True)
class Split:
    """A ZeRO-3 parameter's shards as `gather` quantizes them: each device's
    part of it (its ZeRO shard, and within that its compute layout's part)
    one row of contiguous elements."""

    dim: int  # the dimension the ZeRO axes split
    axes: tuple[str, ...]  # those axes
    n: int  # their total size
    local: tuple[int, ...]  # one ZeRO shard's shape
    split: tuple  # per dimension of a shard, the compute entry splitting it (None: whole)
    parts: tuple[int, ...]  # per dimension of a shard, into how many parts that entry splits it
    row: int  # one device's elements

    def grid(self) -> tuple[int, ...]:
        """(n, the split dimensions' parts, each dimension's local extent)."""
        return (self.n, *(t for t in self.parts if t > 1),
                *(size // t for size, t in zip(self.local, self.parts)))

    def rows_spec(self, over, ndim: int) -> PartitionSpec:
        """The layout of the (n, parts..., ...) views, the leading axis over `over`."""
        split = tuple(e for e, t in zip(self.split, self.parts) if t > 1)
        return PartitionSpec(over, *split, *(None,) * (ndim - 1 - len(split)))


def split_of(shape, stored: PartitionSpec, compute: PartitionSpec,
             mesh_shape: dict[str, int]) -> Split | None:
    """How `gather` sees a parameter stored by `stored` and used by `compute`
    (None: nothing to gather)."""
    kept, split = entries(compute, len(shape)), entries(stored, len(shape))
    dims = [d for d in range(len(shape)) if split[d] != kept[d]]
    if not dims:
        return None
    (d,) = dims  # ZeRO takes one dimension no other axis splits (zero.zero_dim)
    axes = entry_axes(split[d])
    n = math.prod(mesh_shape[a] for a in axes)
    local = (*shape[:d], shape[d] // n, *shape[d + 1:])
    parts = tuple(math.prod(mesh_shape[a] for a in entry_axes(e)) for e in kept)
    return Split(d, axes, n, local, tuple(kept), parts, math.prod(local) // math.prod(parts))


def _to_rows(x: jax.Array, s: Split) -> jax.Array:
    """(n, *local) -> (n, parts..., row): each device's elements contiguous."""
    halves = [(t, size // t) if t > 1 else (size,) for size, t in zip(s.local, s.parts)]
    x = x.reshape(s.n, *(k for h in halves for k in h))
    outer, inner, i = [], [], 1
    for h in halves:
        if len(h) == 2:
            outer.append(i)
        inner.append(i + len(h) - 1)
        i += len(h)
    return x.transpose(0, *outer, *inner).reshape(s.n, *(t for t in s.parts if t > 1), s.row)


def _from_rows(x: jax.Array, s: Split) -> jax.Array:
    """The inverse of `_to_rows`."""
    grid = s.grid()
    x = x.reshape(grid)
    split = [i for i, t in enumerate(s.parts) if t > 1]
    k = len(split)
    order = [0]
    for i in range(len(s.local)):
        if i in split:
            order.append(1 + split.index(i))
        order.append(1 + k + i)
    return x.transpose(order).reshape(s.n, *s.local)


def gather(w: jax.Array, stored: NamedSharding, compute: NamedSharding, block: int,
           dtype) -> jax.Array:
    """w, stored split over ZeRO axes on one dimension, in `dtype` and its
    compute layout, all-gathered in int8 blocks."""
    mesh = stored.mesh
    s = split_of(w.shape, stored.spec, compute.spec, dict(mesh.shape))
    if s is None:
        return jax.lax.with_sharding_constraint(w.astype(dtype), compute)
    zero = s.axes[0] if len(s.axes) == 1 else s.axes

    def pin(a, over):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s.rows_spec(over, a.ndim)))

    # Each device's part as one row, beside a leading axis laid out over the ZeRO axes.
    d = s.dim
    x = jnp.moveaxis(w.reshape(*w.shape[:d], s.n, s.local[d], *w.shape[d + 1:]), d, 0)
    q, scale = quantize(pin(_to_rows(x, s), zero), block)
    q, scale = pin(q, zero), pin(scale, zero)
    q, scale = pin(q, None), pin(scale, None)  # the all-gather, in int8
    x = _from_rows(dequantize(q, scale, s.row, dtype), s)
    x = jnp.moveaxis(x, 0, d).reshape(w.shape)
    return jax.lax.with_sharding_constraint(x, compute)


def reduce_scatter(partials: jax.Array, batch_axes: tuple[str, ...], stored: NamedSharding,
                   compute: NamedSharding, block: int, dtype) -> jax.Array:
    """qgZ: the sum of per-device partial gradients `partials` (S, *w),
    S laid out over `batch_axes`, into w's stored layout, in `dtype`.

    Each device quantizes its partial sum in int8 blocks of its ZeRO
    shards' rows; an all-to-all over the ZeRO axes hands each device every
    peer's blocks of its own shard, which it dequantizes and sums in
    float32. What the batch splits beyond the ZeRO axes (hybrid sharding)
    is then summed over in float32, on the shard only."""
    mesh = stored.mesh
    shape = partials.shape[1:]
    s = split_of(shape, stored.spec, compute.spec, dict(mesh.shape))
    rest = tuple(a for a in batch_axes if a not in s.axes)
    # S as (the other batch axes, one dimension over the ZeRO axes in their
    # order), so that the exchange is one all-to-all between two dimensions.
    order = [batch_axes.index(a) for a in (*rest, *s.axes)]
    x = partials.reshape(*(mesh.shape[a] for a in batch_axes), *shape)
    x = x.transpose(*order, *range(len(batch_axes), x.ndim))
    x = x.reshape(*(mesh.shape[a] for a in rest), s.n, *shape)
    k = len(rest) + 1
    d = k + s.dim
    x = jnp.moveaxis(x.reshape(*x.shape[:d], s.n, s.local[s.dim], *x.shape[d + 1:]), d, k)
    rows = jax.vmap(lambda a: _to_rows(a, s))(x.reshape(-1, s.n, *s.local))
    rows = rows.reshape(*x.shape[:k], *rows.shape[1:])
    zero = s.axes[0] if len(s.axes) == 1 else s.axes

    def pin(a, over_peers, over_n):
        inner = s.rows_spec(over_n, a.ndim - k)
        return jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, PartitionSpec(*rest, over_peers, *inner)))

    q, scale = quantize(pin(rows, zero, None), block)
    q, scale = pin(q, zero, None), pin(scale, zero, None)
    q, scale = pin(q, None, zero), pin(scale, None, zero)  # the all-to-all, in int8
    x = pin(dequantize(q, scale, s.row, jnp.float32), None, zero).sum(k - 1)
    x = x.sum(tuple(range(len(rest))))  # the other batch axes, on the shard: hybrid
    x = jnp.moveaxis(_from_rows(x, s), 0, s.dim).reshape(shape)
    return jax.lax.with_sharding_constraint(x.astype(dtype), stored)
