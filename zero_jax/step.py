"""The train and eval steps: pure functions, jitted here and nowhere else.

`train_step(state, batch) -> (state, metrics)` is one function for every ZeRO
stage, layout, precision and pipeline schedule: those only change the
shardings it is jitted with, the hooks the model is called with, the layout
and dtype gradients are pinned to, and how the loss and gradients of the
batch are computed (accumulated microbatches, or a pipeline schedule). The
state is donated, so XLA updates it in place.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax import loss_scale as loss_scale_lib
from zero_jax import pipeline as pipeline_lib
from zero_jax.accumulate import accumulate
from zero_jax.hooks import Hooks
from zero_jax.loss import cross_entropy
from zero_jax.model import ModelFns
from zero_jax.schedule import Schedule
from zero_jax.state import Layout, TrainState


def lm_loss(model: ModelFns, hooks: Hooks, params: Any, tokens_BxT1: jax.Array) -> jax.Array:
    """Next-token loss of a (B, T + 1) token batch."""
    logits = model.apply(params, tokens_BxT1[:, :-1], hooks)
    return cross_entropy(logits, tokens_BxT1[:, 1:])


def train_step(state: TrainState, batch: jax.Array, *, loss_and_grads: Callable,
               tx: optax.GradientTransformation, lr: optax.Schedule,
               scale_cfg: loss_scale_lib.LossScaleConfig) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step. `loss_and_grads(params, batch, scale)` returns the
    mean loss and its gradients, both times `scale` (accumulated or pipelined)."""
    scale = state.loss_scale.scale
    loss, grads = loss_and_grads(state.params, batch, scale if scale_cfg.enabled else None)
    if scale_cfg.enabled:
        loss = loss / scale
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)
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


def accumulated(loss_fn: Callable, microbatches: int, constrain_grads: Callable,
                constrain_micro: Callable) -> Callable:
    """loss_and_grads by gradient accumulation over `microbatches` (accumulate.py)."""

    def loss_and_grads(params, batch, scale):
        scaled = loss_fn if scale is None else (lambda p, b: loss_fn(p, b) * scale)
        return accumulate(jax.value_and_grad(scaled), params, batch, microbatches,
                          constrain_grads, constrain_micro)

    return loss_and_grads


def pipelined(layout: Layout, model: ModelFns, hooks: Hooks, sched: Schedule,
              constrain_grads: Callable, gather_once: bool) -> Callable:
    """loss_and_grads through the pipeline schedule `sched` (pipeline.py)."""
    fns = model.pipeline
    _, stack_specs = fns.split(layout.specs.params)
    _, stack_grads = fns.split(layout.specs.grads)
    outer_compute, stack_compute = fns.split(layout.specs.compute)
    is_spec = lambda x: isinstance(x, PartitionSpec)
    within = lambda specs, lead: jax.tree.map(  # a stage's view: `pipe` left out
        lambda s: PartitionSpec(*lead, None, *tuple(s)[1:]), specs, is_leaf=is_spec)

    def loss_and_grads(params, batch, scale):
        loss, grads = pipeline_lib.loss_and_grads(
            fns, hooks, sched, layout.mesh, params, batch,
            jnp.float32(1.0) if scale is None else scale, stack_specs, layout.grad_dtype,
            stage_grad_specs=within(stack_grads, (None,)),
            gather_specs=(outer_compute, within(stack_compute, ())) if gather_once else None)
        return loss, constrain_grads(grads)

    return loss_and_grads


def _constrainer(layout: Layout, specs: Any, dtype) -> Callable[[Any], Any]:
    shardings = layout.named(specs)
    return lambda tree: jax.lax.with_sharding_constraint(
        jax.tree.map(lambda g: g.astype(dtype), tree), shardings)


def make_loss_and_grads(layout: Layout, model: ModelFns, hooks: Hooks, microbatches: int,
                        sched: Schedule | None = None, gather_once: bool = False) -> Callable:
    """`(params, batch, scale) -> (loss, grads)` for a layout: pipelined over
    `pipe` through `sched` if given, else accumulated over microbatches.
    Gradients come out in the layout's gradient sharding and dtype."""
    constrain_grads = _constrainer(layout, layout.specs.grads, hooks.grad_dtype)
    if sched is not None:
        return pipelined(layout, model, hooks, sched, constrain_grads, gather_once)
    micro = NamedSharding(layout.mesh, PartitionSpec(None, *layout.batch_sharding.spec))
    return accumulated(functools.partial(lm_loss, model, hooks), microbatches, constrain_grads,
                       lambda x: jax.lax.with_sharding_constraint(x, micro))


def jit_train_step(layout: Layout, model: ModelFns, hooks: Hooks, tx: optax.GradientTransformation,
                   lr: optax.Schedule, microbatches: int,
                   scale_cfg: loss_scale_lib.LossScaleConfig, sched: Schedule | None = None,
                   gather_once: bool = False):
    """`train_step` bound to a layout, jitted with its shardings, state donated."""
    loss_and_grads = make_loss_and_grads(layout, model, hooks, microbatches, sched, gather_once)
    step = functools.partial(train_step, loss_and_grads=loss_and_grads, tx=tx, lr=lr,
                             scale_cfg=scale_cfg)
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(layout.shardings, layout.batch_sharding),
                   out_shardings=(layout.shardings, replicated), donate_argnums=0)


def jit_eval_step(layout: Layout, model: ModelFns, hooks: Hooks):
    """Mean validation loss of a batch, with the parameters where they are stored."""
    loss_fn = functools.partial(lm_loss, model, hooks)
    return jax.jit(loss_fn, in_shardings=(layout.shardings.params, layout.batch_sharding),
                   out_shardings=NamedSharding(layout.mesh, PartitionSpec()))
