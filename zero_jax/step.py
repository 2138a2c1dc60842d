"""The train and eval steps: pure functions, jitted here and nowhere else.

`train_step(state, batch) -> (state, metrics)` is one function for every ZeRO
stage: the stage only changes the shardings it is jitted with and the layout
gradients are pinned to. The state is donated, so XLA updates it in place.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax.accumulate import accumulate
from zero_jax.loss import cross_entropy
from zero_jax.model import ModelFns
from zero_jax.state import Layout, TrainState


def lm_loss(model: ModelFns, hooks, params: Any, tokens_BxT1: jax.Array) -> jax.Array:
    """Next-token loss of a (B, T + 1) token batch."""
    logits = model.apply(params, tokens_BxT1[:, :-1], hooks)
    return cross_entropy(logits, tokens_BxT1[:, 1:])


def train_step(state: TrainState, batch: jax.Array, *, loss_fn: Callable, tx: optax.GradientTransformation,
               lr: optax.Schedule, microbatches: int, constrain_grads: Callable,
               constrain_micro: Callable) -> tuple[TrainState, dict[str, jax.Array]]:
    loss, grads = accumulate(jax.value_and_grad(loss_fn), state.params, batch, microbatches,
                             constrain_grads, constrain_micro)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),  # before clipping
        "lr": jnp.asarray(lr(state.step), jnp.float32),  # the rate this update used
        "tokens": jnp.asarray(batch.shape[0] * (batch.shape[1] - 1), jnp.int32),
    }
    return TrainState(state.step + 1, params, opt_state), metrics


def _constrainer(layout: Layout, specs: Any) -> Callable[[Any], Any]:
    shardings = layout.named(specs)
    return lambda tree: jax.lax.with_sharding_constraint(tree, shardings)


def jit_train_step(layout: Layout, model: ModelFns, tx: optax.GradientTransformation,
                   lr: optax.Schedule, microbatches: int):
    """`train_step` bound to a layout, jitted with its shardings, state donated."""
    batch_spec = layout.batch_sharding.spec
    micro = NamedSharding(layout.mesh, PartitionSpec(None, *batch_spec))
    step = functools.partial(
        train_step,
        loss_fn=functools.partial(lm_loss, model, layout.hooks),
        tx=tx, lr=lr, microbatches=microbatches,
        constrain_grads=_constrainer(layout, layout.specs.grads),
        constrain_micro=lambda x: jax.lax.with_sharding_constraint(x, micro))
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(layout.shardings, layout.batch_sharding),
                   out_shardings=(layout.shardings, replicated), donate_argnums=0)


def jit_eval_step(layout: Layout, model: ModelFns):
    """Mean validation loss of a batch, with the parameters where they are stored."""
    loss_fn = functools.partial(lm_loss, model, layout.hooks)
    return jax.jit(loss_fn, in_shardings=(layout.shardings.params, layout.batch_sharding),
                   out_shardings=NamedSharding(layout.mesh, PartitionSpec()))
