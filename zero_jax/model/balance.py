"""Aux-loss-free load balancing (DeepSeek-V3, Wang et al. 2024): a bias per
expert, added to the router's scores to choose a token's experts and to
nothing else, moved after each step against the load error, outside the
gradient.

The bias is a float32 parameter named `expert_bias`, one per routed expert
(stacked over layers like the rest), so it is sharded, checkpointed and
restored onto any mesh like every other parameter, and a Hugging Face
import brings DeepSeek's `e_score_correction_bias` into it. The router
reports the copies it sent to each expert as the bias's "gradient"
(`reported`): where gradients are summed (microbatches, batch shards,
pipeline ticks) those sums are the batch's loads. The optimizer sees zeros
for it (no decay, no moments, no part in the gradient norm), and the step
then moves it by `rate` a step (`advance`):

    b_e <- b_e + rate * sign(mean_e load - load_e)

raising the bias of an expert that got fewer copies than the mean and
lowering it for one that got more (DeepSeek-V3's gamma, 0.001 for most
of its pre-training). At rate 0 the bias stays as it was loaded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

NAME = "expert_bias"


def is_bias(path) -> bool:
    """Whether a tree path (jax.tree_util key path) names a selection bias."""
    last = path[-1] if path else None
    return getattr(last, "key", getattr(last, "name", None)) == NAME


@jax.custom_vjp
def reported(x: jax.Array, bias_E: jax.Array, load_E: jax.Array) -> jax.Array:
    """x itself; in the backward pass the bias's gradient is `load_E`, the
    copies routed to each expert (float32), whatever reaches x."""
    return x


def _reported_fwd(x, bias_E, load_E):
    return x, load_E


def _reported_bwd(load_E, g):
    return g, load_E.astype(jnp.float32), jnp.zeros_like(load_E)


reported.defvjp(_reported_fwd, _reported_bwd)


def without_loads(grads: Any) -> Any:
    """The gradients an optimizer sees: zeros for the selection biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if is_bias(path) else g, grads)


def advance(new_params: Any, old_params: Any, grads: Any, rate: float) -> Any:
    """`new_params` with each selection bias moved by `rate` against its
    layer's load error (the reported loads in `grads`, last axis the experts)."""
    def one(path, new, old, load):
        if not is_bias(path):
            return new
        if not rate:
            return old
        load = load.astype(jnp.float32)
        error = jnp.mean(load, axis=-1, keepdims=True) - load
        return (old + rate * jnp.sign(error)).astype(old.dtype)
    return jax.tree_util.tree_map_with_path(one, new_params, old_params, grads)
