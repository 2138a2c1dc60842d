"""Float32 master weights inside the sharded optimizer state (ZeRO-1 and 2).

Mixed precision as the ZeRO paper counts it, 2 + 2 + 12 bytes per parameter:
a working copy of the parameters in the compute dtype, the gradients, and in
the optimizer state the float32 master weights beside the moments. At ZeRO
stages 1 and 2 the parameters are replicated and the optimizer state is
sharded, so keeping the master copy in the optimizer state shards it too:

    stored parameters   the working copy, replicated (what the model reads)
    optimizer state     MasterState(master, inner): float32 weights and the
                        wrapped transformation's state, both sharded

Each device updates its shard of the master weights with any optax
transformation, casts the new shard to the working dtype and the working
copy is re-assembled by an all-gather of that narrow copy: 2 bytes per
parameter instead of 4.

Where parameters and optimizer state are stored alike (stage 0, both
replicated; stage 3, both sharded) a second copy would only add bytes: there
the float32 parameters are the master weights and are cast at use.

The working dtype of a parameter is the one the model uses it in
(`use_dtypes`, found by tracing the model with hooks that record each use):
matrices and tables in the compute dtype, but
LayerNorm scales and biases, which the model asks for in float32, stay
float32. So a ZeRO stage changes where bytes live, never the model's
arithmetic.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zero_jax.model.hooks import Gathered, Hooks


class MasterState(NamedTuple):
    master: Any  # the float32 parameters, laid out like the optimizer state
    inner: Any  # the wrapped transformation's state


def wrap(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` applied to float32 master weights kept in its state.

    `init` takes the float32 parameters. `update` steps the master weights
    and returns the updates it applied; the caller casts the new working
    copy from the state's new masters (`apply`), since adding updates to a
    narrow copy would round differently from casting the new master.
    """

    def init(params):
        return MasterState(params, tx.init(params))

    def update(grads, state, params=None):
        del params  # the master weights are the parameters being optimised
        updates, inner = tx.update(grads, state.inner, state.master)
        return updates, MasterState(optax.apply_updates(state.master, updates), inner)

    return optax.GradientTransformation(init, update)


def apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
          to_working: Callable[[Any], Any],
          then: Callable[[Any, Any], Any] = lambda new, old: new) -> tuple[Any, Any]:
    """(new parameters, new optimizer state) after one update.

    With master weights the parameters are the working copy cast from the
    new master weights (`to_working`); otherwise optax's updates are added.
    `then(new, old)` finishes the new parameters from the old, the master
    weights where they are kept (FP8 amax histories advance: they are
    saved from there).
    """
    updates, new_state = tx.update(grads, opt_state, params)
    if isinstance(new_state, MasterState):
        master = then(new_state.master, opt_state.master)
        return to_working(master), new_state._replace(master=master)
    return then(optax.apply_updates(params, updates), params), new_state


def cast_to(dtypes: Any) -> Callable[[Any], Any]:
    """Casts a parameter tree leaf by leaf to `dtypes` (a tree of dtypes)."""
    return lambda tree: jax.tree.map(lambda x, d: x.astype(d), tree, dtypes)


def _array(w):
    """A parameter, or one copy of a gathered one."""
    if isinstance(w, Gathered):
        return w.table[0] if w.axes else w.table
    return w


class _Recording(Hooks):
    """Hooks that note the dtype each parameter is used in (no mesh, no remat)."""

    def __init__(self, compute_dtype: str, uses: dict, kinds: dict):
        super().__init__(compute_dtype=compute_dtype)
        object.__setattr__(self, "uses", uses)
        object.__setattr__(self, "kinds", kinds)

    def _note(self, w, names, dtype, kind):
        key = (tuple(names), tuple(_array(w).shape))
        widest = self.uses.get(key)
        dtype = jnp.dtype(dtype)
        if widest is None or dtype.itemsize > widest.itemsize:
            self.uses[key] = dtype
        self.kinds[key] = self.kinds.get(key, frozenset()) | {kind}

    def weight(self, w, names, dtype=None):
        self._note(w, names, dtype or self.dtype, "weight")
        return super().weight(w, names, dtype)

    def dense(self, eq, x, w, names, fp8=False, history=None):
        # An FP8 amax history is unused here: float32.
        self._note(w, names, self.dtype, "fp8" if fp8 else "dense")
        return super().dense(eq, x, w, names, fp8, history)

    def lookup(self, w, ids, names, out_dtype=None):
        self._note(w, names, self.dtype, "lookup")
        return super().lookup(w, ids, names, out_dtype)

    def gathered(self, w, names):
        self._note(w, names, self.dtype, "gathered")
        return super().gathered(w, names)


def _traced(apply, abstract_params, compute_dtype: str, tokens_shape) -> tuple[dict, dict]:
    """(dtype, kinds of use) per (logical names, shape) of a parameter, from
    tracing `apply` with recording hooks."""
    uses: dict = {}
    kinds: dict = {}
    tokens = jax.ShapeDtypeStruct(tokens_shape, jnp.int32)
    jax.eval_shape(lambda p, t: apply(p, t, _Recording(compute_dtype, uses, kinds)),
                   abstract_params, tokens)
    return uses, kinds


def _per_leaf(table: dict, abstract_params, names, default):
    """`table`'s entry for each parameter, a scanned `layers` dimension left out."""
    def one(leaf, spec):
        kept = [(n, size) for n, size in zip(tuple(spec), leaf.shape) if n != "layers"]
        key = (tuple(n for n, _ in kept), tuple(size for _, size in kept))
        return table.get(key, default)

    return jax.tree.map(one, abstract_params, names)


def use_dtypes(apply, abstract_params, names, compute_dtype: str, tokens_shape=(1, 8),
               unused_dtype=jnp.float32):
    """The dtype the model uses each parameter in, found by tracing `apply`.

    Parameters are matched to their uses by logical names and shape, with a
    scanned `layers` dimension left out (the model sees one layer's slice).
    A parameter used in several dtypes gets the widest; one never used gets
    `unused_dtype`.
    """
    uses, _ = _traced(apply, abstract_params, compute_dtype, tokens_shape)
    return _per_leaf(uses, abstract_params, names, jnp.dtype(unused_dtype))


def product_only(apply, abstract_params, names, tokens_shape=(1, 8)) -> tuple[Any, Any]:
    """Per parameter, whether the model uses it only as a matrix product's
    weight (`Hooks.dense`: what ZeRO++'s quantized gradient reduction
    reaches), and only as an FP8 product's (what FP8 gathers in 8 bits
    under `--precision fp8`), matched as `use_dtypes` matches."""
    _, kinds = _traced(apply, abstract_params, "float32", tokens_shape)
    per_leaf = _per_leaf(kinds, abstract_params, names, frozenset())
    return (jax.tree.map(lambda k: bool(k) and k <= {"dense", "fp8"}, per_leaf),
            jax.tree.map(lambda k: k == frozenset({"fp8"}), per_leaf))
