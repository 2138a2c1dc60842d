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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding

from zero_jax.remat import DOT, WEIGHT, Remat
from zero_jax.rules import AxisRules
from zero_jax.zero import Placement


def _put(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _gather(w, stored, compute, dtype):
    # Pinning the cast to the stored layout first makes the gather that the
    # compute layout needs move `dtype` bytes: without it XLA may gather the
    # float32 master copy and cast afterwards.
    return _put(_put(w.astype(dtype), stored), compute)


def _reduce(g, stored, compute, like):
    return _put(_put(g, compute), stored).astype(like.dtype)


# --- weight: elementwise use -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _use(w, stored, compute, dtype, grad_dtype):
    return _gather(w, stored, compute, dtype)


def _use_fwd(w, stored, compute, dtype, grad_dtype):
    # The residual is a zero-size array of w's dtype: the backward needs the
    # dtype only, and residuals must be arrays.
    return _use(w, stored, compute, dtype, grad_dtype), jnp.zeros((0,), w.dtype)


def _use_bwd(stored, compute, dtype, grad_dtype, like, g):
    return (_reduce(g.astype(grad_dtype), stored, compute, like),)


_use.defvjp(_use_fwd, _use_bwd)


# --- dense: use in a matrix product ------------------------------------------

def _operands(eq: str) -> tuple[str, str, str]:
    inputs, out = eq.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5, 6))
def _dense(eq, x, w, stored, compute, dtype, grad_dtype):
    return jnp.einsum(eq, x, _gather(w, stored, compute, dtype))


def _dense_fwd(eq, x, w, stored, compute, dtype, grad_dtype):
    return _dense(eq, x, w, stored, compute, dtype, grad_dtype), (x, w)


def _dense_bwd(eq, stored, compute, dtype, grad_dtype, res, g):
    x, w = res
    xs, ws, ys = _operands(eq)
    dx = jnp.einsum(f"{ys},{ws}->{xs}", g, _gather(w, stored, compute, dtype))
    dw = jnp.einsum(f"{xs},{ys}->{ws}", x, g, preferred_element_type=grad_dtype)
    return dx.astype(x.dtype), _reduce(dw, stored, compute, w)


_dense.defvjp(_dense_fwd, _dense_bwd)


# --- lookup: rows of a table -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _lookup(w, ids, stored, compute, dtype, grad_dtype):
    return jnp.take(_gather(w, stored, compute, dtype), ids, axis=0)


def _lookup_fwd(w, ids, stored, compute, dtype, grad_dtype):
    return _lookup(w, ids, stored, compute, dtype, grad_dtype), (w, ids)


def _lookup_bwd(stored, compute, dtype, grad_dtype, res, g):
    w, ids = res
    dw = jnp.zeros(w.shape, grad_dtype).at[ids].add(g.astype(grad_dtype))
    return _reduce(dw, stored, compute, w), None


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

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    def _sharding(self, shape, names: Sequence[str | None], what: str):
        if self.mesh is None:
            return None
        spec = self.rules.spec(names, shape, dict(self.mesh.shape), what=what)
        return NamedSharding(self.mesh, spec)

    def _layouts(self, w, names):
        compute = self._sharding(w.shape, names, f"weight {tuple(names)}")
        stored = None
        if compute is not None and self.stored is not None:
            stored = NamedSharding(self.mesh, self.stored.spec(w.shape, compute.spec, names))
        return stored, compute

    def act(self, x: jax.Array, names: Sequence[str | None], name: str | None = None) -> jax.Array:
        """An activation, laid out by the rules; `name` tags it for remat policies."""
        x = _put(x, self._sharding(x.shape, names, f"activation {tuple(names)}"))
        return checkpoint_name(x, name) if name else x

    def weight(self, w: jax.Array, names: Sequence[str | None], dtype=None) -> jax.Array:
        """A parameter for elementwise use, in `dtype` (default: the compute dtype)."""
        w = _use(w, *self._layouts(w, names), jnp.dtype(dtype or self.dtype),
                 jnp.dtype(self.grad_dtype))
        return checkpoint_name(w, WEIGHT)  # never kept for backward: gathered again

    def dense(self, eq: str, x: jax.Array, w: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """einsum(eq, x, w) with w in the compute dtype and layout."""
        y = _dense(eq, x, w, *self._layouts(w, names), self.dtype, jnp.dtype(self.grad_dtype))
        return checkpoint_name(y, DOT)  # a matrix product, for dots_saveable

    def lookup(self, w: jax.Array, ids: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """Rows `ids` of the table w, in the compute dtype."""
        return _lookup(w, ids, *self._layouts(w, names), self.dtype, jnp.dtype(self.grad_dtype))
