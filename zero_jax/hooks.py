"""What a model calls to place, cast and name its tensors, and to use its
parameters.

A model names logical axes and nothing else; these hooks turn the names into
sharding constraints for the current mesh and rules, apply the precision
policy, and carry the activation-checkpointing policy. Without a mesh they
only cast, so a model runs unchanged on one device.

Constraining each activation to the batch split tells XLA to move weights
rather than activations. A parameter is used through one of three calls:

    dense(eq, x, w, names)   w in a matrix product (einsum `eq`, x first)
    lookup(w, ids, names)    rows of w (an embedding table)
    weight(w, names, dtype)  w in elementwise work (LayerNorm, biases)

and `gathered(w, names)` gathers w once for several of these (a tied
embedding's lookup and head).

Each casts w to the compute dtype (elementwise ones may ask for float32),
pins the cast copy to w's stored layout and then to its compute layout: a
ZeRO-3 parameter, stored sharded, is all-gathered there, one layer at a time
inside the scanned stack, in the compute dtype. In the backward pass `dense`
and `lookup` compute the parameter's gradient in the gradient dtype
(bf16 x bf16 products accumulated in float32), so the reduction over the
batch that XLA inserts runs in that dtype, and reduce-scatter it into the
stored layout. They keep x and the stored shard for the backward pass, never
the gathered copy: it is gathered again, as FSDP does. Stored in host memory
(`host_params`, offload.py), the shard is brought to the device first.

`per_shard(axes)` gives the hooks for the rows of one shard of the batch
over some data-parallel axes, run under `vmap` over those shards
(accumulate.py): the batch is split only over the other data-parallel axes,
and gradients are reduced over those only, so what comes out is this
device's partial sum over `axes`, to be reduced once per optimizer step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zero_jax.remat import DOT, WEIGHT, Remat
from zero_jax.sharding.rules import AxisRules
from zero_jax.sharding.zero import Placement


def _put(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


@dataclasses.dataclass(frozen=True)
class _Use:
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

    def gather(self, w):
        if self.fetch is not None:
            w = jax.device_put(w, self.fetch)
        # Pinning the cast to the stored layout first makes the gather that the
        # compute layout needs move `dtype` bytes: without it XLA may gather the
        # float32 master copy and cast afterwards.
        return _put(_put(w.astype(self.dtype), self.stored), self.compute)

    def reduce(self, g):
        if self.gathered:
            return g.astype(self.param_dtype)
        return _put(_put(g, self.compute), self.reduce_to).astype(self.param_dtype)


# --- weight: elementwise use -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weight(use: _Use, w):
    return use.gather(w)


def _weight_fwd(use, w):
    return use.gather(w), None


def _weight_bwd(use, _, g):
    return (use.reduce(g.astype(use.grad_dtype)),)


_weight.defvjp(_weight_fwd, _weight_bwd)


# --- dense: use in a matrix product ------------------------------------------

def _operands(eq: str) -> tuple[str, str, str]:
    inputs, out = eq.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dense(use: _Use, eq: str, x, w):
    return jnp.einsum(eq, x, use.gather(w))


def _dense_fwd(use, eq, x, w):
    return _dense(use, eq, x, w), (x, use.gather(w) if use.gathered else w)


def _dense_bwd(use, eq, res, g):
    x, w = res
    xs, ws, ys = _operands(eq)
    dx = jnp.einsum(f"{ys},{ws}->{xs}", g, w if use.gathered else use.gather(w))
    dw = jnp.einsum(f"{xs},{ys}->{ws}", x, g, preferred_element_type=use.grad_dtype)
    return dx.astype(x.dtype), use.reduce(dw)


_dense.defvjp(_dense_fwd, _dense_bwd)


# --- lookup: rows of a table -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lookup(use: _Use, out_dtype, w, ids):
    return jnp.take(use.gather(w), ids, axis=0).astype(out_dtype)


def _lookup_fwd(use, out_dtype, w, ids):
    # Only the table's shape is needed backward: keep a zero-size stand-in.
    return _lookup(use, out_dtype, w, ids), (jnp.zeros((0,) + w.shape, w.dtype), ids)


def _lookup_bwd(use, out_dtype, res, g):
    shape, ids = res
    dw = jnp.zeros(shape.shape[1:], use.grad_dtype).at[ids].add(g.astype(use.grad_dtype))
    return use.reduce(dw), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


# --- gathered: one gather for several uses ------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_once(use: _Use, split: NamedSharding | None, w):
    # Returned in the gradient dtype, so that the uses' gradients are summed
    # in it; each use casts back to the compute dtype, which XLA folds into
    # the gather's output. With `split`, one copy per shard of the batch (a
    # leading dimension over the batch axes, no extra bytes per device): each
    # shard's gradient stays a partial sum until the one reduction.
    w = use.gather(w).astype(use.grad_dtype)
    if split is None:
        return w
    axes = split.spec[0] if isinstance(split.spec[0], tuple) else (split.spec[0],)
    n = math.prod(split.mesh.shape[a] for a in axes)
    return _put(jnp.broadcast_to(w, (n,) + w.shape), split)


def _gather_once_fwd(use, split, w):
    return _gather_once(use, split, w), None


def _gather_once_bwd(use, split, _, g):
    if split is not None:
        g = _put(g, split).sum(0, dtype=use.grad_dtype)
    return (use.reduce(g.astype(use.grad_dtype)),)


_gather_once.defvjp(_gather_once_fwd, _gather_once_bwd)


def psum(x: jax.Array, axis: str, widen: bool) -> jax.Array:
    """Sum over the manual mesh `axis`. XLA:CPU's all-reduce promotion aborts
    on a bf16 all-reduce inside shard_map ("Invalid binary instruction opcode
    copy"), so with `widen` (on CPU) bf16 is summed in float32 and cast back."""
    if widen and x.dtype == jnp.bfloat16:
        return jax.lax.psum(x.astype(jnp.float32), axis).astype(x.dtype)
    return jax.lax.psum(x, axis)


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Tables whose rows are split in contiguous blocks over a manual mesh
    axis (a pipeline's evaluation, inside `shard_map`): each device holds
    block `axis_index(axis)` of every table and of the logits over it."""

    axis: str
    size: int  # the axis's size: the number of blocks
    widen: bool = False  # sum bf16 in float32 (`psum`)

    def block(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one device's block of a table of `shape`."""
        return (shape[0] // self.size, *shape[1:])

    def offset(self, rows: int) -> jax.Array:
        """The global index of this device's first row, of `rows` per device."""
        return jax.lax.axis_index(self.axis) * rows

    def sum(self, x: jax.Array) -> jax.Array:
        return psum(x, self.axis, self.widen)


class Gathered(NamedTuple):
    """A parameter gathered once (Hooks.gathered), for `lookup` and `dense`."""

    table: jax.Array  # in the compute layout, in the gradient dtype; split: (shards, ...)
    names: tuple  # its logical axes
    axes: tuple | None  # the batch axes of the leading per-shard dimension, if split


def _array(w):
    """A parameter, or one copy of a gathered one."""
    if isinstance(w, Gathered):
        return w.table[0] if w.axes else w.table
    return w


@dataclasses.dataclass(frozen=True)
class Hooks:
    """Sharding, precision and rematerialisation, by logical name."""

    mesh: Mesh | None = None  # the mesh the step runs on (None: one device, no constraints)
    rules: AxisRules | None = None  # logical -> mesh axes
    compute_dtype: str = "float32"  # parameters are cast to this at use
    grad_dtype: str = "float32"  # parameter gradients are computed and reduced in this dtype
    remat: Remat = Remat()  # which block activations the backward pass keeps
    stored: Placement | None = None  # ZeRO split of stored parameters (stage 3), else None
    partial_grads: bool = False  # leave gradients unreduced in the compute layout (per_shard)
    rows: RowSplit | None = None  # tables are row blocks over a manual axis (lookup, vocab_ids)
    host_params: bool = False  # stored parameters are in host memory, fetched at each use
    attention: str = "xla"  # jax.nn.dot_product_attention's implementation: xla | cudnn
    scan_layers: bool = True  # False: the layer stack is unrolled (one copy of each layer in the program)

    def per_shard(self, axes: Sequence[str]) -> "Hooks":
        """These hooks for one shard of the batch over the data-parallel mesh
        `axes`, under `vmap` over the shards (its spmd axes: `axes`).

        The batch stays split over the other data-parallel axes. A stored
        (ZeRO-3) gradient is still reduce-scattered into its shard over the
        ZeRO axes, unless they are among `axes`; then it is left unreduced.
        """
        batch = tuple(a for a in self.rules.mesh_axes("batch") if a not in axes)
        crosses = self.stored is not None and bool(set(self.stored.axes) & set(axes))
        return dataclasses.replace(self, rules=self.rules.replace(batch=batch),
                                   partial_grads=crosses)

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    def _sharding(self, shape, names: Sequence[str | None], what: str):
        if self.mesh is None:
            return None
        spec = self.rules.spec(names, shape, dict(self.mesh.shape), what=what)
        return NamedSharding(self.mesh, spec)

    def _use(self, w, names, dtype=None) -> _Use:
        compute = self._sharding(w.shape, names, f"weight {tuple(names)}")
        stored = None
        if compute is not None and self.stored is not None:
            stored = NamedSharding(self.mesh, self.stored.spec(w.shape, compute.spec, names))
        return _Use(stored, compute, jnp.dtype(dtype or self.dtype), jnp.dtype(self.grad_dtype),
                    w.dtype, None if self.partial_grads else stored,
                    fetch=stored if self.host_params else None)

    def act(self, x: jax.Array, names: Sequence[str | None], name: str | None = None) -> jax.Array:
        """An activation, laid out by the rules; `name` tags it for remat policies."""
        x = _put(x, self._sharding(x.shape, names, f"activation {tuple(names)}"))
        return checkpoint_name(x, name) if name else x

    def weight(self, w: jax.Array, names: Sequence[str | None], dtype=None) -> jax.Array:
        """A parameter for elementwise use, in `dtype` (default: the compute dtype)."""
        w = _weight(self._use(w, names, dtype), w)
        return checkpoint_name(w, WEIGHT)  # never kept for backward: gathered again

    def dense(self, eq: str, x: jax.Array, w: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """einsum(eq, x, w) with w in the compute dtype and layout."""
        if isinstance(w, Gathered):
            y = self._on_gathered(lambda use, x, t: _dense(use, eq, x, t), w, names, x)
        else:
            y = _dense(self._use(w, names), eq, x, w)
        return checkpoint_name(y, DOT)  # a matrix product, for dots_saveable

    def lookup(self, w: jax.Array, ids: jax.Array, names: Sequence[str | None],
               out_dtype=None) -> jax.Array:
        """Rows `ids` of the table w, gathered in the compute dtype and returned
        in `out_dtype` (default: the compute dtype). Rows returned in float32
        get a float32 gradient: a sum over the batch that then reaches the
        reduction across devices unrounded."""
        out_dtype = jnp.dtype(out_dtype or self.dtype)
        if isinstance(w, Gathered):
            return self._on_gathered(lambda use, i, t: _lookup(use, out_dtype, t, i), w, names, ids)
        if self.rows is not None:
            # This device's block of rows: each id is read where it is
            # stored, zeros elsewhere, and the blocks' results summed (one
            # nonzero term each, so the sum is exact in any dtype).
            n = w.shape[0]
            local = ids - self.rows.offset(n)
            inside = (local >= 0) & (local < n)
            y = _lookup(self._use(w, names), out_dtype, w, jnp.clip(local, 0, n - 1))
            return self.rows.sum(jnp.where(inside[..., None], y, jnp.zeros((), y.dtype)))
        return _lookup(self._use(w, names), out_dtype, w, ids)

    def table_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a table parameter of `shape` has here: this device's
        block of rows under `rows`, else the whole."""
        return shape if self.rows is None else self.rows.block(shape)

    def vocab_ids(self, n: int) -> jax.Array:
        """Global indices of the last dimension's n entries of logits over a
        table's rows: 0..n-1, or this device's block under `rows`."""
        ids = jnp.arange(n)
        return ids if self.rows is None else ids + self.rows.offset(n)

    def gathered(self, w: jax.Array, names: Sequence[str | None]) -> "Gathered":
        """w gathered once for several uses (a tied embedding's lookup and
        head): `lookup` and `dense` take the result in place of w, with the
        batch as the leading dimension of their other operand.

        The copy is gathered in the compute dtype and kept until its last
        use, as FSDP keeps its root module's parameters through the forward
        pass. The uses' gradients are summed on the device, in the gradient
        dtype, and reduced once instead of once per use: where the gradient
        is reduced on the spot (ZeRO-3, per microbatch), each batch shard's
        copy gets its own partial sum, a full-size gradient held through the
        backward pass, as FSDP holds its root's unsharded gradient.
        """
        use = self._use(w, names)
        axes = self._split_axes()
        split = None
        if axes:
            compute = use.compute.spec if use.compute is not None else ()
            split = NamedSharding(self.mesh, PartitionSpec(axes, *compute))
        return Gathered(_gather_once(use, split, w), tuple(names), axes)

    def _split_axes(self) -> tuple[str, ...] | None:
        """The batch axes over which a gathered table's uses keep per-shard
        gradients: where this device's gradients are reduced on the spot."""
        if self.mesh is None or self.stored is None or self.partial_grads:
            return None
        axes = tuple(a for a in self.rules.mesh_axes("batch") if self.mesh.shape[a] > 1)
        return axes or None

    def _on_gathered(self, fn, g: "Gathered", names, x):
        """fn(use, x, table) for a table from `gathered`; x's leading dimension is the batch."""
        if tuple(names) != g.names:
            raise ValueError(f"a table gathered as {g.names} is used as {tuple(names)}")
        shape = g.table.shape[1:] if g.axes else g.table.shape
        compute = self._sharding(shape, names, f"weight {tuple(names)}")
        # Already in the compute layout: no gather here, and no reduction.
        use = _Use(None, compute, self.dtype, jnp.dtype(self.grad_dtype), g.table.dtype,
                   None, gathered=True)
        if not g.axes:
            return fn(use, x, g.table)
        n = g.table.shape[0]
        if x.shape[0] % n:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {n} shards")
        x_n = _put(x.reshape(n, x.shape[0] // n, *x.shape[1:]),
                   NamedSharding(self.mesh, PartitionSpec(g.axes)))
        y_n = jax.vmap(functools.partial(fn, use), spmd_axis_name=g.axes)(x_n, g.table)
        return y_n.reshape(x.shape[0], *y_n.shape[2:])


class _Recording(Hooks):
    """Hooks that note the dtype each parameter is used in (no mesh, no remat)."""

    def __init__(self, compute_dtype: str, uses: dict):
        super().__init__(compute_dtype=compute_dtype)
        object.__setattr__(self, "uses", uses)

    def _note(self, w, names, dtype):
        key = (tuple(names), tuple(_array(w).shape))
        widest = self.uses.get(key)
        dtype = jnp.dtype(dtype)
        if widest is None or dtype.itemsize > widest.itemsize:
            self.uses[key] = dtype

    def weight(self, w, names, dtype=None):
        self._note(w, names, dtype or self.dtype)
        return super().weight(w, names, dtype)

    def dense(self, eq, x, w, names):
        self._note(w, names, self.dtype)
        return super().dense(eq, x, w, names)

    def lookup(self, w, ids, names, out_dtype=None):
        self._note(w, names, self.dtype)
        return super().lookup(w, ids, names, out_dtype)

    def gathered(self, w, names):
        self._note(w, names, self.dtype)
        return super().gathered(w, names)


def use_dtypes(apply, abstract_params, names, compute_dtype: str, tokens_shape=(1, 8),
               unused_dtype=jnp.float32):
    """The dtype the model uses each parameter in, found by tracing `apply`.

    Parameters are matched to their uses by logical names and shape, with a
    scanned `layers` dimension left out (the model sees one layer's slice).
    A parameter used in several dtypes gets the widest; one never used gets
    `unused_dtype`.
    """
    uses: dict = {}
    tokens = jax.ShapeDtypeStruct(tokens_shape, jnp.int32)
    jax.eval_shape(lambda p, t: apply(p, t, _Recording(compute_dtype, uses)),
                   abstract_params, tokens)

    def per_leaf(leaf, spec):
        kept = [(n, size) for n, size in zip(tuple(spec), leaf.shape) if n != "layers"]
        key = (tuple(n for n, _ in kept), tuple(size for _, size in kept))
        return uses.get(key, jnp.dtype(unused_dtype))

    return jax.tree.map(per_leaf, abstract_params, names)
