"""The attention scores' hand-written backward (models/common/layers.py): the
gradients autodiff gives the einsum in float32, rounded once in bfloat16,
and a keys' product the CPU's matmul library takes whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.common import layers


def _grads(scores, q, k, g):
    _, vjp = jax.vjp(scores, q, k)
    return vjp(g)


# bfloat16: the float32 gradient rounded once, within half a unit in the
# last place, 2**-9 of the value (measured: at most 0.0037 relative).
@pytest.mark.parametrize("dtype, rtol, atol", [(jnp.float32, 1e-6, 1e-6), (jnp.bfloat16, 2**-8, 0)])
def test_scores_gradients_equal_autodiffs(dtype, rtol, atol):
    """Against autodiff of the same product in float32, from the same
    inputs. Autodiff's own bfloat16 gradient is not always that rounded
    once: under jaxlib 0.11.2 XLA:CPU rounds its keys' product on the way
    (37% off on one element of this example)."""
    B, T, S, H, Q = 2, 8, 12, 3, 4
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, H, Q), dtype)
    k = jax.random.normal(keys[1], (B, S, H, Q), dtype)
    g = jax.random.normal(keys[2], (B, H, T, S), dtype)
    ours = _grads(layers.scores_bhts, q, k, g)
    wide = [x.astype(jnp.float32) for x in (q, k, g)]
    exact = _grads(lambda q, k: jnp.einsum("bthq,bshq->bhts", q, k), *wide)
    for a, b in zip(ours, exact):
        assert a.dtype == dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=rtol, atol=atol)
    np.testing.assert_array_equal(layers.scores_bhts(q, k),
                                  jnp.einsum("bthq,bshq->bhts", q, k))


def test_the_keys_product_reads_the_scores_gradient_as_laid_out():
    """Every product of the compiled backward contracts its first operand
    along that operand's last dimension: autodiff's keys' product contracts
    the B x H x T x S gradient along its rows (lhs_contracting_dims={2}),
    which XLA:CPU runs outside its fast kernels."""
    q = jnp.ones((2, 16, 2, 8))
    text = jax.jit(jax.grad(lambda q, k: jnp.sum(layers.scores_bhts(q, k) ** 2),
                            argnums=(0, 1))).lower(q, q).compile().as_text()
    dots = [line for line in text.splitlines() if " dot(" in line]
    assert len(dots) >= 3, dots  # the forward's and both gradients'
    assert all("lhs_contracting_dims={3}" in line for line in dots), dots
