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

Each casts w to the compute dtype (elementwise ones may ask for float32),
pins the cast copy to w's stored layout and then to its compute layout: a
ZeRO-3 parameter, stored sharded, is all-gathered there, one layer at a time
inside the scanned stack, in the compute dtype. In the backward pass `dense`
and `lookup` compute the parameter's gradient in the gradient dtype
(bf16 x bf16 products accumulated in float32), so the reduction over the
batch that XLA inserts runs in that dtype, and reduce-scatter it into the
stored layout. They keep x and the stored shard for the backward pass, never
the gathered copy: it is gathered again, as FSDP does.

`per_shard(axes)` gives the hooks for the rows of one shard of the batch
over some data-parallel axes, run under `vmap` over those shards
(accumulate.py): the batch is split only over the other data-parallel axes,
and gradients are reduced over those only, so what comes out is this
device's partial sum over `axes`, to be reduced once per optimizer step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding

from zero_jax.remat import DOT, WEIGHT, Remat
from zero_jax.rules import AxisRules
from zero_jax.zero import Placement


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

    def gather(self, w):
        # Pinning the cast to the stored layout first makes the gather that the
        # compute layout needs move `dtype` bytes: without it XLA may gather the
        # float32 master copy and cast afterwards.
        return _put(_put(w.astype(self.dtype), self.stored), self.compute)

    def reduce(self, g):
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
    return _dense(use, eq, x, w), (x, w)


def _dense_bwd(use, eq, res, g):
    x, w = res
    xs, ws, ys = _operands(eq)
    dx = jnp.einsum(f"{ys},{ws}->{xs}", g, use.gather(w))
    dw = jnp.einsum(f"{xs},{ys}->{ws}", x, g, preferred_element_type=use.grad_dtype)
    return dx.astype(x.dtype), use.reduce(dw)


_dense.defvjp(_dense_fwd, _dense_bwd)


# --- lookup: rows of a table -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lookup(use: _Use, out_dtype, w, ids):
    return jnp.take(use.gather(w), ids, axis=0).astype(out_dtype)


def _lookup_fwd(use, out_dtype, w, ids):
    return _lookup(use, out_dtype, w, ids), (w, ids)


def _lookup_bwd(use, out_dtype, res, g):
    w, ids = res
    dw = jnp.zeros(w.shape, use.grad_dtype).at[ids].add(g.astype(use.grad_dtype))
    return use.reduce(dw), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


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
                    w.dtype, None if self.partial_grads else stored)

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
        y = _dense(self._use(w, names), eq, x, w)
        return checkpoint_name(y, DOT)  # a matrix product, for dots_saveable

    def lookup(self, w: jax.Array, ids: jax.Array, names: Sequence[str | None],
               out_dtype=None) -> jax.Array:
        """Rows `ids` of the table w, gathered in the compute dtype and returned
        in `out_dtype` (default: the compute dtype). Rows returned in float32
        get a float32 gradient: a sum over the batch that then reaches the
        reduction across devices unrounded."""
        return _lookup(self._use(w, names), jnp.dtype(out_dtype or self.dtype), w, ids)


class _Recording(Hooks):
    """Hooks that note the dtype each parameter is used in (no mesh, no remat)."""

    def __init__(self, compute_dtype: str, uses: dict):
        super().__init__(compute_dtype=compute_dtype)
        object.__setattr__(self, "uses", uses)

    def _note(self, w, names, dtype):
        key = (tuple(names), tuple(w.shape))
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
