"""The three ways a model uses a parameter, and the one gather shared by
several uses, as custom VJPs (what `Hooks.weight`, `dense`, `lookup` and
`gathered` run).

Each casts w to the compute dtype (elementwise uses may ask for float32),
pins the cast copy to w's stored layout and then to its compute layout: a
ZeRO-3 parameter, stored sharded, is all-gathered there, one layer at a time
inside the scanned stack, in the compute dtype. In the backward pass `dense`
and `lookup` compute the parameter's gradient in the gradient dtype
(bf16 x bf16 products accumulated in float32), so the reduction over the
batch that XLA inserts runs in that dtype, and reduce-scatter it into the
stored layout. They keep x and the stored shard for the backward pass, never
the gathered copy: it is gathered again, as FSDP does. Stored in host memory
(`host_params`, offload.py), the shard is brought to the device first.

Custom VJPs, not plain sharding constraints, because autodiff would
otherwise decide both where the gradient is reduced and in which dtype,
and would keep the gathered copy for the backward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax.model import fp8
from zero_jax.sharding import quantized
from zero_jax.sharding.specs import entries, entry_axes


def put(x, sharding):
    """x constrained to `sharding`, or x itself where there is none (one device)."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def psum(x: jax.Array, axis, widen: bool) -> jax.Array:
    """Sum over the manual mesh `axis`. XLA:CPU's all-reduce promotion aborts
    on a bf16 all-reduce inside shard_map ("Invalid binary instruction opcode
    copy"), so with `widen` (on CPU) bf16 is summed in float32 and cast back."""
    if widen and x.dtype == jnp.bfloat16:
        return jax.lax.psum(x.astype(jnp.float32), axis).astype(x.dtype)
    return jax.lax.psum(x, axis)


def block_rows(ids: jax.Array, first: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Where global row `ids` fall in a block of `n` rows starting at row
    `first`: their indices in the block (clipped into it) and whether each
    is inside."""
    local = ids - first
    return jnp.clip(local, 0, n - 1), (local >= 0) & (local < n)


def inside_only(x: jax.Array, inside: jax.Array) -> jax.Array:
    """x's rows (one per id) where `inside` (block_rows), zeros elsewhere."""
    return jnp.where(inside[..., None], x, jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True)
class ManualRows:
    """A table's compute layout splits its rows over the mesh `axes`, inside
    a region manual over other axes (a pipeline's shard_map). XLA's SPMD
    partitioner aborts on a gather from rows split over its automatic axes
    there (jaxlib 0.11.2 and 0.12: a check in its device groups;
    docs/pipelines.md has the reproduction), so `lookup` splits
    it by hand, as Megatron's vocabulary-parallel embedding does: in a
    shard_map manual over `axes`, each device reads the ids in its block of
    rows, zeros elsewhere, and the blocks' results are summed (one nonzero
    term each: exact in any dtype); backward, each adds the gradients of its
    own rows. The same collective the partitioner would insert."""

    axes: tuple[str, ...]  # the mesh axes that split the rows
    widen: bool  # sum bf16 in float32 (`psum`)
    # the axes a surrounding vmap lays the batch out over (Hooks.per_shard):
    # manual in the region too, where jax's vmap of a shard_map splits them
    vmapped: tuple[str, ...] = ()

    def take(self, t: jax.Array, ids: jax.Array) -> jax.Array:
        def block(t, ids):
            n = t.shape[0]
            at, inside = block_rows(ids, jax.lax.axis_index(self.axes) * n, n)
            return psum(inside_only(jnp.take(t, at, axis=0), inside), self.axes, self.widen)
        return self._region(block, (PartitionSpec(self.axes), PartitionSpec()), PartitionSpec())(
            t, ids)

    def add_at(self, shape: tuple[int, ...], ids: jax.Array, g: jax.Array) -> jax.Array:
        def block(ids, g):
            n = shape[0] // jax.lax.axis_size(self.axes)
            at, inside = block_rows(ids, jax.lax.axis_index(self.axes) * n, n)
            return jnp.zeros((n, *shape[1:]), g.dtype).at[at].add(inside_only(g, inside))
        return self._region(block, (PartitionSpec(), PartitionSpec()), PartitionSpec(self.axes))(
            ids, g)

    def _region(self, fn, in_specs, out_specs):
        # The mesh is the surrounding region's (its other manual axes stay so).
        return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs,
                             axis_names={*self.axes, *self.vmapped}, check_vma=False)


@dataclasses.dataclass(frozen=True)
class Use:
    """How one parameter is used: static, so the custom VJPs take it whole."""

    stored: NamedSharding | None  # where the parameter lives (ZeRO-3: sharded)
    compute: NamedSharding | None  # where it is used
    dtype: Any  # it is cast to this before it is gathered
    grad_dtype: Any  # its gradient is computed and reduced in this dtype
    param_dtype: Any  # the gradient's dtype on the way out (the parameter's)
    reduce_to: NamedSharding | None  # the gradient's layout (None: this device's partial sum)
    # w is already gathered (Hooks.gathered): the backward pass keeps the cast
    # copy, and leaves the gradient unconstrained for the gather's own reduction
    gathered: bool = False
    # w is stored in host memory (offload.py): this device's shard is brought
    # to the device, in this layout, before it is cast and gathered
    fetch: NamedSharding | None = None
    # the weight gradient may merge the rows (batch, sequence) of its operands
    # into one dimension: false where the sequence is split over devices, so
    # that a merge would mix two splits (Hooks._use)
    flat_rows: bool = False
    # a table's rows split by hand in `lookup`, inside a manual region (ManualRows)
    manual_rows: ManualRows | None = None
    # > 0: gathered in int8 with a scale per block of about this many elements
    # (ZeRO++'s qwZ, sharding/quantized.py), quantized from the stored copy
    int8_block: int = 0
    # > 0: a product's weight gradient reduced in int8 blocks of about this
    # many elements (ZeRO++'s qgZ), from per-device partial sums over the
    # batch's mesh axes `batch_axes` (sharding/quantized.py)
    int8_reduce_block: int = 0
    batch_axes: tuple[str, ...] = ()

    def gather(self, w):
        if self.fetch is not None:
            w = jax.device_put(w, self.fetch)
        if self.int8_block and self.stored is not None and self.compute is not None:
            return quantized.gather(w, self.stored, self.compute, self.int8_block, self.dtype)
        # Pinning the cast to the stored layout first makes the gather that the
        # compute layout needs move `dtype` bytes: without it XLA may gather the
        # float32 master copy and cast afterwards.
        return put(put(w.astype(self.dtype), self.stored), self.compute)

    def gather_fp8(self, w, history=None):
        """w rounded to e4m3 where it is stored, gathered in 8 bits, and its
        scale: its own, or the amax `history` row's (fp8.delayed). The
        gather moves a byte per element."""
        if self.fetch is not None:
            w = jax.device_put(w, self.fetch)
        w = put(w, self.stored)
        q, scale = fp8.current(w, fp8.E4M3) if history is None else fp8.delayed(w, fp8.E4M3, history)
        return put(put(q, self.stored), self.compute), scale

    def reduce(self, g):
        if self.gathered:
            return g.astype(self.param_dtype)
        return put(put(g, self.compute), self.reduce_to).astype(self.param_dtype)


# --- weight: elementwise use -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def weight(use: Use, w):
    """w gathered for elementwise use (LayerNorm, biases)."""
    return use.gather(w)


def _weight_fwd(use, w):
    return use.gather(w), None


def _weight_bwd(use, _, g):
    return (use.reduce(g.astype(use.grad_dtype)),)


weight.defvjp(_weight_fwd, _weight_bwd)


# --- dense: use in a matrix product ------------------------------------------

def operands(eq: str) -> tuple[str, str, str]:
    inputs, out = eq.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def dense(use: Use, eq: str, x, w):
    """einsum(eq, x, w) with w gathered; its gradient in the gradient dtype."""
    return jnp.einsum(eq, x, use.gather(w))


def _dense_fwd(use, eq, x, w):
    return dense(use, eq, x, w), (x, use.gather(w) if use.gathered else w)


def _input_grad(use, eq, x, w, g):
    xs, ws, ys = operands(eq)
    dx = jnp.einsum(f"{ys},{ws}->{xs}", g, w if use.gathered else use.gather(w))
    return dx.astype(x.dtype)


def dense_weight_grad(use: Use, eq: str, x, g):
    """The gradient of w in einsum(eq, x, w) from x and the output's
    gradient g, in the gradient dtype, reduced into w's stored layout."""
    xs, ws, ys = operands(eq)
    if _int8_reduces(use, xs, ws, ys, x, g):
        partials = _per_device(use, xs, ws, ys, x, g)
        return quantized.reduce_scatter(partials, use.batch_axes, use.reduce_to, use.compute,
                                        use.int8_reduce_block, use.grad_dtype).astype(use.param_dtype)
    # One dtype throughout: XLA:CPU's plain dot has no bf16 x bf16 -> f32 kernel.
    same = x.dtype == g.dtype == jnp.dtype(use.grad_dtype)
    flat = _rows_contraction(xs, ws, ys, x, g, use.grad_dtype) if use.flat_rows and same else None
    if flat is None:
        flat = jnp.einsum(f"{xs},{ys}->{ws}", x, g, preferred_element_type=use.grad_dtype)
    return use.reduce(flat)


def _int8_reduces(use: Use, xs: str, ws: str, ys: str, x, g) -> bool:
    """Whether qgZ reduces this gradient: ZeRO-3 reducing it on the spot, the
    batch the leading dimension of both operands, split over mesh axes that
    include every ZeRO axis of w (else it is reduced in the gradient dtype)."""
    if not (use.int8_reduce_block and use.reduce_to is not None and use.compute is not None
            and use.batch_axes and xs[0] == ys[0] and xs[0] not in ws):
        return False
    sizes = {**dict(zip(xs, x.shape)), **dict(zip(ys, g.shape))}
    mesh = use.reduce_to.mesh
    split = quantized.split_of(tuple(sizes[c] for c in ws), use.reduce_to.spec, use.compute.spec,
                               dict(mesh.shape))
    return split is not None and set(split.axes) <= set(use.batch_axes)


def _per_device(use: Use, xs: str, ws: str, ys: str, x, g):
    """Each device's partial sum of the weight gradient over its rows of the
    batch: (S, *w), S laid out over the batch's mesh axes."""
    mesh = use.reduce_to.mesh
    n = math.prod(mesh.shape[a] for a in use.batch_axes)
    z = next(c for c in "ZYXWVUTSRQ" if c not in xs + ys)
    x = x.reshape(n, x.shape[0] // n, *x.shape[1:])
    g = g.reshape(n, g.shape[0] // n, *g.shape[1:])
    p = jnp.einsum(f"{z}{xs},{z}{ys}->{z}{ws}", x, g, preferred_element_type=use.grad_dtype)
    spec = PartitionSpec(use.batch_axes, *entries(use.compute.spec, p.ndim - 1))
    return put(p, NamedSharding(mesh, spec))


def _rows_contraction(xs: str, ws: str, ys: str, x, g, dtype):
    """einsum(f"{xs},{ys}->{ws}", x, g) as one product over rows: the
    letters x and y share and w lacks (batch, sequence) lead both in the
    same order, and are merged into one row dimension (a reshape of leading
    dimensions, no data movement). The operand left with one other dimension
    becomes the product's left side, contracted along its rows as it is laid
    out, and only the weight-sized result is transposed into w's order.

    Written as the einsum, the compiler moves the rows of x to the minor end
    first: a transposing copy of every kept activation a weight gradient
    reads (XLA:CPU's dot canonicalisation). None when the letters do not fit."""
    rows = [c for c in xs if c in ys and c not in ws]
    n = len(rows)
    if not rows or xs[:n] != "".join(rows) or ys[:n] != "".join(rows):
        return None
    x_rest, y_rest = xs[n:], ys[n:]
    if sorted(x_rest + y_rest) != sorted(ws):
        return None  # a letter shared with w as well (a batched product)
    if len(x_rest) == 1:
        lhs, rhs, lhs_rest, rhs_rest = x, g, x_rest, y_rest
    elif len(y_rest) == 1:
        lhs, rhs, lhs_rest, rhs_rest = g, x, y_rest, x_rest
    else:
        return None
    count = math.prod(x.shape[:n])
    lhs = lhs.reshape(count, lhs.shape[-1])
    rhs = rhs.reshape(count, *rhs.shape[n:])
    out = jax.lax.dot_general(lhs, rhs, (((0,), (0,)), ((), ())), preferred_element_type=dtype)
    order = lhs_rest + rhs_rest
    return out if order == ws else jnp.transpose(out, [order.index(c) for c in ws])


def _dense_bwd(use, eq, res, g):
    x, w = res
    return _input_grad(use, eq, x, w, g), dense_weight_grad(use, eq, x, g)


dense.defvjp(_dense_fwd, _dense_bwd)


# --- tapped dense: the input gradient now, the weight's later ------------------

@jax.tree_util.register_pytree_node_class
class Tapped:
    """A stacked weight (layers first) with its taps: zeros shaped as the
    input and output of its product in every layer, whose cotangents
    `tapped_dense` makes the product's input and output gradient. A
    backward taken with respect to the taps (and not the weight) gives
    what the weight's gradient needs, without computing it
    (pipeline/weight_grad.py). Flattens weight first: a module checks the
    shape of the first leaf of what it is given as a parameter."""

    def __init__(self, w, x=None, y=None, seen=None):
        self.w, self.x, self.y, self.seen = w, x, y, seen

    def tree_flatten(self):
        return (self.w, self.x, self.y), self.seen

    @classmethod
    def tree_unflatten(cls, seen, leaves):
        return cls(*leaves, seen=seen)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def tapped_dense(use: Use, eq: str, x, w, tap_x, tap_y):
    """einsum(eq, x, w), whose backward gives x's gradient, and as the
    taps' cotangents x itself and the output's gradient (not w's)."""
    return jnp.einsum(eq, x, use.gather(w))


def _tapped_fwd(use, eq, x, w, tap_x, tap_y):
    return tapped_dense(use, eq, x, w, tap_x, tap_y), (x, w)


def _tapped_bwd(use, eq, res, g):
    x, w = res
    return _input_grad(use, eq, x, w, g), jnp.zeros_like(w), x, g


tapped_dense.defvjp(_tapped_fwd, _tapped_bwd)


# --- lookup: rows of a table -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def lookup(use: Use, out_dtype, w, ids):
    """Rows `ids` of the gathered table w, in `out_dtype`."""
    t = use.gather(w)
    y = jnp.take(t, ids, axis=0) if use.manual_rows is None else use.manual_rows.take(t, ids)
    return y.astype(out_dtype)


def _lookup_fwd(use, out_dtype, w, ids):
    # Only the table's shape is needed backward: keep a zero-size stand-in.
    return lookup(use, out_dtype, w, ids), (jnp.zeros((0,) + w.shape, w.dtype), ids)


def _lookup_bwd(use, out_dtype, res, g):
    shape, ids = res
    g = g.astype(use.grad_dtype)
    if use.manual_rows is None:
        dw = jnp.zeros(shape.shape[1:], use.grad_dtype).at[ids].add(g)
    else:
        dw = use.manual_rows.add_at(shape.shape[1:], ids, g)
    return use.reduce(dw), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


# --- gathered: one gather for several uses ------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def gather_once(use: Use, split: NamedSharding | None, w):
    """w gathered once for several uses (Hooks.gathered)."""
    # Returned in the gradient dtype, so that the uses' gradients are summed
    # in it; each use casts back to the compute dtype, which XLA folds into
    # the gather's output. With `split`, one copy per shard of the batch (a
    # leading dimension over the batch axes, no extra bytes per device): each
    # shard's gradient stays a partial sum until the one reduction.
    w = use.gather(w).astype(use.grad_dtype)
    if split is None:
        return w
    n = math.prod(split.mesh.shape[a] for a in entry_axes(split.spec[0]))
    return put(jnp.broadcast_to(w, (n,) + w.shape), split)


def _gather_once_fwd(use, split, w):
    return gather_once(use, split, w), None


def _gather_once_bwd(use, split, _, g):
    if split is not None:
        g = put(g, split).sum(0, dtype=use.grad_dtype)
    return (use.reduce(g.astype(use.grad_dtype)),)


gather_once.defvjp(_gather_once_fwd, _gather_once_bwd)
