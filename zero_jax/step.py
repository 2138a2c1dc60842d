"""The train and eval steps: pure functions, jitted here and nowhere else.

`train_step(state, batch) -> (state, metrics)` is one function for every ZeRO
stage, layout and precision: those only change the shardings it is jitted
with, the hooks the model is called with, and the layout and dtype gradients
are pinned to. The state is donated, so XLA updates it in place.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax import loss_scale as loss_scale_lib
from zero_jax.accumulate import accumulate
from zero_jax.hooks import Hooks
from zero_jax.loss import cross_entropy
from zero_jax.model import ModelFns
from zero_jax.state import Layout, TrainState


def lm_loss(model: ModelFns, hooks: Hooks, params: Any, tokens_BxT1: jax.Array) -> jax.Array:
    """Next-token loss of a (B, T + 1) token batch."""
    logits = model.apply(params, tokens_BxT1[:, :-1], hooks)
    return cross_entropy(logits, tokens_BxT1[:, 1:])


def train_step(state: TrainState, batch: jax.Array, *, loss_fn: Callable,
               tx: optax.GradientTransformation, lr: optax.Schedule, microbatches: int,
               scale_cfg: loss_scale_lib.LossScaleConfig, constrain_grads: Callable,
               constrain_micro: Callable) -> tuple[TrainState, dict[str, jax.Array]]:
    scale = state.loss_scale.scale
    if scale_cfg.enabled:
        scaled = lambda params, micro: loss_fn(params, micro) * scale
        loss, grads = accumulate(jax.value_and_grad(scaled), state.params, batch, microbatches,
                                 constrain_grads, constrain_micro)
        loss = loss / scale
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)
    else:
        loss, grads = accumulate(jax.value_and_grad(loss_fn), state.params, batch, microbatches,
                                 constrain_grads, constrain_micro)
    grad_norm = optax.tree.norm(grads)  # before clipping
    finite = jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A step with non-finite gradients leaves parameters and optimizer state
    # bitwise as they were; only the step count and the loss scale move.
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_scale = loss_scale_lib.update(scale_cfg, state.loss_scale, finite)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        # The rate this update used: optax counts applied updates only.
        "lr": jnp.asarray(lr(state.step - state.loss_scale.skipped), jnp.float32),
        "tokens": jnp.asarray(batch.shape[0] * (batch.shape[1] - 1), jnp.int32),
        "loss_scale": scale,  # the scale this step ran with
        "skipped": ~finite,
        "consecutive_skips": new_scale.consecutive,
    }
    new_state = TrainState(state.step + 1, keep(params, state.params),
                           keep(opt_state, state.opt_state), new_scale)
    return new_state, metrics


def jit_train_step(layout: Layout, model: ModelFns, hooks: Hooks, tx: optax.GradientTransformation,
                   lr: optax.Schedule, microbatches: int,
                   scale_cfg: loss_scale_lib.LossScaleConfig):
    """`train_step` bound to a layout, jitted with its shardings, state donated."""
    batch_spec = layout.batch_sharding.spec
    micro = NamedSharding(layout.mesh, PartitionSpec(None, *batch_spec))
    grads = layout.named(layout.specs.grads)
    grad_dtype = hooks.grad_dtype
    step = functools.partial(
        train_step,
        loss_fn=functools.partial(lm_loss, model, hooks),
        tx=tx, lr=lr, microbatches=microbatches, scale_cfg=scale_cfg,
        constrain_grads=lambda tree: jax.lax.with_sharding_constraint(
            jax.tree.map(lambda g: g.astype(grad_dtype), tree), grads),
        constrain_micro=lambda x: jax.lax.with_sharding_constraint(x, micro))
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(layout.shardings, layout.batch_sharding),
                   out_shardings=(layout.shardings, replicated), donate_argnums=0)


def jit_eval_step(layout: Layout, model: ModelFns, hooks: Hooks):
    """Mean validation loss of a batch, with the parameters where they are stored."""
    loss_fn = functools.partial(lm_loss, model, hooks)
    return jax.jit(loss_fn, in_shardings=(layout.shardings.params, layout.batch_sharding),
                   out_shardings=NamedSharding(layout.mesh, PartitionSpec()))
