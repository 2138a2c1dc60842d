"""The rounding no-ops remat adds (zero_jax/precision/rounding.py): float32 ones go,
16-bit ones stay, and the gradients are bitwise what they were."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core

from zero_jax.precision import rounding


def _roundings(fn, *args) -> list[tuple[str, int, int]]:
    """(dtype, exponent bits, mantissa bits) of every reduce_precision in
    fn's jaxpr, nested ones included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "reduce_precision":
                found.append((str(eqn.invars[0].aval.dtype), eqn.params["exponent_bits"],
                              eqn.params["mantissa_bits"]))
            for sub in core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _block(w, x):
    """A remat'd layer stack that keeps a named activation of `x`'s dtype."""
    policy = jax.checkpoint_policies.save_only_these_names("kept")

    def layer(h, w_i):
        y = checkpoint_name(jnp.tanh(h @ w_i.astype(h.dtype)), "kept")
        return jnp.sin(y) * h, None

    h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, w)
    return jnp.sum(h.astype(jnp.float32) ** 2)


def test_float32_roundings_are_removed_and_gradients_are_bitwise_unchanged():
    w = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 16))
    grad = jax.grad(_block, argnums=(0, 1))
    assert ("float32", 8, 23) in _roundings(grad, w, x)  # remat adds them
    stripped = rounding.without_no_op_rounding(grad)
    assert _roundings(stripped, w, x) == []
    for a, b in zip(jax.jit(grad)(w, x), jax.jit(stripped)(w, x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sixteen_bit_roundings_stay():
    """A bfloat16 value may be held in float32 inside a fusion: rounding it
    to bfloat16 changes it, so it is kept."""
    w = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 16)).astype(jnp.bfloat16)
    grad = jax.grad(_block, argnums=(0, 1))
    before = _roundings(grad, w, x)
    assert ("bfloat16", 8, 7) in before
    assert _roundings(rounding.without_no_op_rounding(grad), w, x) == [
        r for r in before if r[0] == "bfloat16"]


def test_pytrees_in_and_out_keep_their_structure():
    def fn(tree, scale):
        return {"sum": tree["a"] * scale + tree["b"][0], "none": None}, (tree["b"][1],)

    tree = {"a": jnp.ones(3), "b": (jnp.arange(3.0), jnp.zeros(2))}
    out = rounding.without_no_op_rounding(fn)(tree, 2.0)
    expected = fn(tree, 2.0)
    assert jax.tree.structure(out) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
