"""The train and eval steps: pure functions, jitted here and nowhere else.

`train_step(state, batch) -> (state, metrics)` is one function for every ZeRO
stage, layout, precision and pipeline schedule: those only change the
shardings it is jitted with, the hooks the model is called with, the layout
and dtype gradients are pinned to, and how the loss and gradients of the
batch are computed (grads.py: accumulated microbatches, per-device partial
sums, or a pipeline schedule). Its options are one frozen record
(`StepOptions`), bound with `functools.partial` before jitting, as nanodo
binds its config. The state is donated, so XLA updates it in place.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax.model import balance, fp8
from zero_jax.precision import loss_scale as loss_scale_lib
from zero_jax.precision import master as master_lib
from zero_jax.sharding import offload as offload_lib
from zero_jax.sharding import overlap as overlap_lib
from zero_jax.precision import rounding
from zero_jax.pipeline import executor as executor_lib
from zero_jax.pipeline.records import StagePlan
from zero_jax.train import grads
from zero_jax.train.options import StepOptions
from zero_jax.model.hooks import Hooks
from zero_jax.model.loss import expert_load_ratio
from zero_jax.model.contract import ModelFns
from zero_jax.pipeline import schedule as schedule_lib
from zero_jax.runtime import xla_options
from zero_jax.train.state import StatePlan, TrainState


def train_step(state: TrainState, batch: Any, *, loss_and_grads: Callable,
               tx: optax.GradientTransformation, lr: optax.Schedule, state_plan: StatePlan,
               options: StepOptions, balance_rate: float = 0.0
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step. `loss_and_grads(params, batch, scale)` returns the
    batch's metrics (lm_loss's: "loss", the mean next-token loss, and the
    router's) and the training loss's gradients times `scale` (grads.py).
    New master weights are cast to the working copy (master.py); the update
    runs where `state_plan` keeps the optimizer state (`_update_placement`).
    Statistics kept as parameters (FP8 amax histories, experts' selection
    biases) get reports for gradients, which move them instead of the
    optimizer (`balance_rate`: the biases' step)."""
    scale_cfg = options.loss_scale
    scale = state.loss_scale.scale
    batch = grads.weighted(batch)
    measured, g = loss_and_grads(state.params, batch, scale if scale_cfg.enabled else None,
                                 state.frozen, state.step)
    if scale_cfg.enabled:  # amax histories' and biases' reports are not gradients
        g = jax.tree_util.tree_map_with_path(
            lambda path, x: x if fp8.is_history(path) or balance.is_bias(path)
            else (x.astype(jnp.float32) / scale).astype(x.dtype), g)
    grad_norm = optax.tree.norm(_gradients_only(g))  # before clipping
    finite = jnp.isfinite(grad_norm)

    def update(g, opt_state, params, finite):
        # The optimizer sees zeros for the amax histories and selection biases,
        # which the step's reports then move (fp8.py, balance.py): they are
        # statistics, not weights.
        def then(new, old):
            return balance.advance(fp8.advance(new, old, g), old, g, balance_rate)
        new_params, new_opt = master_lib.apply(tx, _gradients_only(g), opt_state, params,
                                               state_plan.to_working, then)
        # A step with non-finite gradients leaves parameters and optimizer state
        # bitwise as they were; only the step count and the loss scale move.
        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        return keep(new_params, params), keep(new_opt, opt_state)

    host, fetch = _update_placement(state_plan)
    run = update if host is None else functools.partial(host.run, update)
    params = state.params if fetch is None else jax.device_put(state.params, fetch)
    params, opt_state = run(g, state.opt_state, params, finite)
    new_scale = loss_scale_lib.update(scale_cfg, state.loss_scale, finite)
    metrics = {
        "loss": measured["loss"],
        **_model_metrics(measured),
        "grad_norm": grad_norm,
        # The rate this update used: optax counts applied updates only.
        "lr": jnp.asarray(lr(state.step - state.loss_scale.skipped), jnp.float32),
        "tokens": jnp.asarray(batch["weights"].size, jnp.int32),
        "loss_scale": scale,  # the scale this step ran with
        "skipped": ~finite,
        "consecutive_skips": new_scale.consecutive,
    }
    new_state = TrainState(state.step + 1, params, opt_state, new_scale, state.frozen)
    return new_state, metrics


def _model_metrics(measured: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """What a model adds to the step's metrics: a mixture's router losses and
    expert loads, the MTP modules' mean loss."""
    out = {}
    if "expert_load" in measured:
        out = {"aux_loss": measured["aux_loss"], "z_loss": measured["z_loss"],
               "expert_load": expert_load_ratio(measured["expert_load"])}
    if "mtp_loss" in measured:
        out["mtp_loss"] = measured["mtp_loss"]
    return out


def _gradients_only(g: Any) -> Any:
    """The gradient tree with the statistics' reports zeroed."""
    return balance.without_loads(fp8.without_histories(g))


def _update_placement(state_plan: StatePlan) -> tuple[offload_lib.HostUpdate | None, Any]:
    """(host, fetch): with `host` the update runs in host memory, where the
    optimizer state is (offload.py), and the new parameters go where they
    are stored; with `fetch` (device shardings) the parameters, stored in
    host memory, are brought to the device for an update there."""
    host = offload_lib.HostUpdate(state_plan.shardings.params) if state_plan.host_opt else None
    fetch = state_plan.named(state_plan.specs.params) \
        if state_plan.host_params and not state_plan.host_opt else None
    return host, fetch


def jit_train_step(state_plan: StatePlan, model: ModelFns, hooks: Hooks,
                   tx: optax.GradientTransformation, lr: optax.Schedule, options: StepOptions):
    """`train_step` bound to a layout and its options, jitted with its
    shardings, state donated; with `options.overlap`, XLA:GPU told to overlap
    the per-layer collectives with the layer scan's compute (overlap.py)."""
    # Traced without the float32 roundings remat adds to what it keeps: no-ops
    # that XLA:GPU deletes and XLA:CPU runs as copies (rounding.py).
    loss_and_grads = rounding.without_no_op_rounding(
        grads.make_loss_and_grads(state_plan, model, hooks, options))
    step = functools.partial(train_step, loss_and_grads=loss_and_grads, tx=tx, lr=lr,
                             state_plan=state_plan, options=options,
                             balance_rate=model.balance_rate)
    replicated = NamedSharding(state_plan.mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(state_plan.shardings, state_plan.batch_sharding),
                   out_shardings=(state_plan.shardings, replicated), donate_argnums=0,
                   compiler_options=compiler_options(state_plan, options.overlap))


def compiler_options(state_plan: StatePlan, overlap: bool,
                     backend: str | None = None) -> dict[str, xla_options.Value] | None:
    """The XLA options a step of `layout` compiles with on `backend` (the
    running one by default): offload's prefetch, and with `overlap` the
    collective pipelining of overlap.py, spelled as this XLA spells them."""
    wants = offload_lib.wants(state_plan.host_params) + (
        overlap_lib.wants(state_plan.zero_stage) if overlap else ())
    return xla_options.spell(wants, backend)


def eval_step(params: Any, batch: Any, *, state_plan: StatePlan, model: ModelFns, hooks: Hooks,
              options: StepOptions) -> jax.Array:
    """The mean loss over a batch's targets, with the parameters where they
    are stored: under a pipeline, through `options.schedule`'s forwards
    (each stage runs the layers it stores; only activations cross `pipe`)."""
    batch = grads.weighted(batch)
    sched = options.schedule
    if sched is None:
        return grads.lm_loss(model, hooks, params, batch)[1]["loss"]
    fns = model.pipeline
    outer_specs, stack_specs = fns.split(state_plan.specs.params)
    where = StagePlan(stack=stack_specs, stage_grads=None, outer_grads=None,
                      grad_dtype=state_plan.grad_dtype, stages=state_plan.stages,
                      outer=outer_specs, names=fns.split(state_plan.names)[0],
                      row_blocks=options.tables_in_rows)
    forwards = schedule_lib.forward_only(sched.name, sched.p, sched.m, sched.v)
    return executor_lib.loss(fns, hooks, forwards, state_plan.mesh, params, batch, where)


def jit_eval_step(state_plan: StatePlan, model: ModelFns, hooks: Hooks, options: StepOptions):
    """`eval_step` bound to a layout and its options, jitted with its shardings."""
    step = functools.partial(eval_step, state_plan=state_plan, model=model, hooks=hooks,
                             options=options)
    return jax.jit(step, in_shardings=(state_plan.model_shardings, state_plan.batch_sharding),
                   out_shardings=NamedSharding(state_plan.mesh, PartitionSpec()),
                   compiler_options=compiler_options(state_plan, options.overlap))
