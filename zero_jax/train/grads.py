"""The loss and gradients of a batch, by the layout's strategy.

`make_loss_and_grads` picks one of three ways to compute
`(params, batch, scale) -> (metrics, grads)`, each giving the gradients in
the layout's gradient sharding and dtype, for the step (step.py) to update
with:

- `accumulated`: each microbatch's gradients reduced into the gradient
  layout and added up there (accumulate.py `accumulate`);
- `partial_sums`: per-device partial sums kept over the data-parallel
  axes that `unreduced_axes` names, through the microbatches, and reduced
  once at the end (accumulate.py `accumulate_partials`);
- `pipelined`: a pipeline schedule over `pipe` (pipeline/executor.py).

The batch is `weighted`, and `lm_loss` is the loss each strategy
differentiates, whatever part of the batch it is given.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax.model import lora
from zero_jax.precision import master as master_lib
from zero_jax.pipeline import executor as executor_lib
from zero_jax.pipeline.records import StagePlan
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.specs import map_specs, without_axis
from zero_jax.train.accumulate import accumulate, accumulate_partials, reduce_partials
from zero_jax.train.options import StepOptions
from zero_jax.context import order as context_order
from zero_jax.model.hooks import Hooks
from zero_jax.model.loss import cross_entropy
from zero_jax.model.contract import ModelFns
from zero_jax.train.state import StatePlan


def weighted(batch: Any) -> dict[str, jax.Array]:
    """A batch as the loss functions take it: {"tokens": (B, T + 1), "weights":
    (B, T) float32, optionally "segment_ids"}.

    A target's weight is its share of the batch's loss, so the weights sum
    to one over the batch: the loss of any part of it (a microbatch, a
    device's rows, a pipeline's microbatch) is that part's weighted sum, and
    the parts add up to the batch's mean over its targets, whatever their
    sizes and loss-mask counts. data.global_batch computes them on the host
    (the count of targets is known to every process, so no collective is
    needed); a bare (B, T + 1) token array weighs every target 1 / (B T).
    """
    if isinstance(batch, dict):
        return batch
    return {"tokens": batch, "weights": jnp.full(batch[:, 1:].shape, 1.0 / batch[:, 1:].size,
                                                 jnp.float32)}


def lm_loss(model: ModelFns, hooks: Hooks, params: Any,
            batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training loss of (part of) a `weighted` batch, and its metrics:
    the next-token loss, its weighted sum ("loss"); for a mixture of
    experts, plus the router losses times their weights (their values
    among the metrics, ModelFns.router_penalty). Every metric is a sum over
    the batch's parts."""
    # Laid out over `context` where the sequence is split (context/order.py).
    order = hooks.sequence_order(batch["tokens"].shape[1] - 1)
    rows = context_order.shifted(batch, order)
    # With segment ids, each document in a row attends to itself only.
    segments = {"segments_BxT": rows["segments"]} if "segments" in rows else {}
    if model.mtp_depth:  # the tokens further ahead, shifted before the layout
        segments["mtp_rows"] = context_order.ahead(batch, model.mtp_depth, order)
    out = model.apply(params, rows["inputs"], hooks, **segments)
    if model.router_penalty is None:
        loss = cross_entropy(out, rows["targets"], rows["weights"])
        return loss, {"loss": loss}
    logits, stats = out
    loss = cross_entropy(logits, rows["targets"], rows["weights"])
    added, router = model.router_penalty(stats, jnp.sum(rows["weights"], axis=-1))
    return loss + added, {"loss": loss, **router}


def _scaled(loss_fn: Callable, scale) -> Callable:
    """`loss_fn` whose training loss (not its metrics) is multiplied by `scale`."""
    if scale is None:
        return loss_fn

    def scaled(params, batch):
        objective, metrics = loss_fn(params, batch)
        return objective * scale, metrics

    return scaled


def _metrics_and_grad(loss_fn: Callable) -> Callable:
    """`(params, batch) -> (metrics, grads of the training loss)` of an lm_loss."""
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def metrics_and_grad(params, batch):
        grads, metrics = grad_fn(params, batch)
        return metrics, grads

    return metrics_and_grad


def accumulated(loss_fn: Callable, microbatches: int, constrain_grads: Callable,
                constrain_micro: Callable) -> Callable:
    """loss_and_grads by gradient accumulation over `microbatches` (accumulate.py)."""

    def loss_and_grads(params, batch, scale):
        return accumulate(_metrics_and_grad(_scaled(loss_fn, scale)), params, batch,
                          microbatches, constrain_grads, constrain_micro)

    return loss_and_grads


def runs_per_device(model: ModelFns, hooks: Hooks) -> bool:
    """Whether the model runs per-device code over the axes that split the
    batch (`Hooks.local`): a mixture of experts' dispatch (models/llama/moe.py),
    attention across `context` (zero_jax/context). The per-shard `vmap` of
    partial sums would split it, so such a step reduces each microbatch."""
    return bool(model.experts) or hooks.context is not None


def unreduced_axes(state_plan: StatePlan, microbatches: int, reduce_once: bool,
                   per_device: bool = False) -> tuple[str, ...]:
    """Data-parallel axes over which the step keeps per-device partial sums of
    the gradients, to reduce them once at its end (accumulate.py).

    Reducing once per step: every data-parallel axis. Even with one
    microbatch this reduces a parameter used twice (a tied embedding) once,
    where reducing at each use would reduce it twice; except at ZeRO-3,
    whose one microbatch is better reduced layer by layer in the backward
    pass (its accumulator stays 1/N). Reducing each microbatch into sharded
    gradients: the axes ZeRO does not shard over (hybrid sharding), whose
    all-reduce of the shards then runs once per step.

    A step that runs code per device (`per_device`, `runs_per_device`)
    reduces each microbatch.
    """
    if per_device:
        return ()
    stage = zero_lib.stage(state_plan.zero_stage)
    if reduce_once and (microbatches > 1 or not stage.params):
        return state_plan.data_axes
    if stage.grads:
        return tuple(a for a in state_plan.data_axes if a not in state_plan.mesh_shape.shard_axes)
    return ()


def partial_sums(state_plan: StatePlan, model: ModelFns, hooks: Hooks, microbatches: int,
                 axes: tuple[str, ...], constrain_grads: Callable) -> Callable:
    """loss_and_grads keeping partial sums over the data-parallel `axes` through
    the microbatches and reducing them at the end (accumulate.py)."""
    sizes = state_plan.mesh_shape.sizes
    n, m = math.prod(sizes[a] for a in axes), microbatches
    local = functools.partial(lm_loss, model, hooks.per_shard(axes))
    # Over the other data-parallel axes (hybrid: the ZeRO axes) each shard's
    # gradient is reduced into its stored layout as usual.
    inside = set(axes) != set(state_plan.data_axes)
    specs = state_plan.specs.grads if inside else state_plan.specs.compute
    partial_specs = map_specs(lambda s: PartitionSpec(axes, *s), specs)
    constrain_partials = _constrainer(state_plan, partial_specs, hooks.grad_dtype)
    constrain_inside = _constrainer(state_plan, specs, hooks.grad_dtype)
    micro = NamedSharding(state_plan.mesh, PartitionSpec(None, axes))

    def value_and_grad(params, rows, scale):
        metrics, grads = _metrics_and_grad(_scaled(local, scale))(params, rows)
        return metrics, constrain_inside(grads) if inside else grads

    def loss_and_grads(params, batch, scale):
        metric_sums, partials = accumulate_partials(
            lambda p, rows: value_and_grad(p, rows, scale), params, batch, m, axes, n,
            constrain_partials, lambda x: jax.lax.with_sharding_constraint(x, micro))
        grads = reduce_partials(partials, state_plan.specs.grads, state_plan.mesh, axes,
                                state_plan.mesh_shape.shard_axes)
        return jax.tree.map(lambda x: x.sum(0), metric_sums), constrain_grads(grads)

    return loss_and_grads


def pipelined(state_plan: StatePlan, model: ModelFns, hooks: Hooks, options: StepOptions,
              constrain_grads: Callable) -> Callable:
    """loss_and_grads through the pipeline schedule `options.schedule`
    (pipeline/executor.py), the tables used in the row blocks they are
    stored in with `options.tables_in_rows`."""
    fns, sched = model.pipeline, options.schedule
    axes = unreduced_axes(state_plan, sched.m, options.reduce_once, runs_per_device(model, hooks))
    sizes = state_plan.mesh_shape.sizes
    # Partial sums over every data-parallel axis are accumulated unreduced
    # (compute layout); otherwise in the gradient layout.
    accumulated = state_plan.specs.compute if set(axes) == set(state_plan.data_axes) and axes \
        else state_plan.specs.grads
    outer_specs, stack_specs = fns.split(state_plan.specs.params)
    outer_acc, stack_acc = fns.split(accumulated)
    outer_compute, stack_compute = fns.split(state_plan.specs.compute)
    where = StagePlan(
        stack=stack_specs, stage_grads=_within_stage(stack_acc, (None,)),
        outer_grads=map_specs(_without_pipe, outer_acc),
        grad_dtype=state_plan.grad_dtype,
        gather=(outer_compute, _within_stage(stack_compute, ())) if options.gather_once else None,
        shard_axes=axes, shards=math.prod(sizes[a] for a in axes), stages=state_plan.stages,
        outer=outer_specs, names=fns.split(state_plan.names)[0],
        row_blocks=options.tables_in_rows)

    def loss_and_grads(params, batch, scale):
        loss, router, grads = executor_lib.loss_and_grads(
            fns, hooks, sched, state_plan.mesh, params, batch,
            jnp.float32(1.0) if scale is None else scale, where)
        if "expert_load" in router and state_plan.stages is not None:  # stored slots -> layers
            router["expert_load"] = state_plan.stages.unpad(router["expert_load"])
        metrics = {"loss": loss if scale is None else loss / scale, **router}
        if axes:
            grads = reduce_partials(grads, state_plan.specs.grads, state_plan.mesh, axes,
                                    state_plan.mesh_shape.shard_axes)
        else:
            grads = jax.tree.map(lambda g: g[0], grads)
        return metrics, constrain_grads(grads)

    return loss_and_grads


def _within_stage(specs: Any, lead: tuple) -> Any:
    """Specs of a layer stack as one stage sees them inside the pipeline's
    shard_map: `lead` dimensions first, then the stack's own, `pipe` left out."""
    return map_specs(lambda s: PartitionSpec(*lead, None, *tuple(s)[1:]), specs)


def _without_pipe(spec: PartitionSpec) -> PartitionSpec:
    """`spec` inside the pipeline's shard_map, where `pipe` is manual: the
    embedding and head are stored split over `pipe` and used whole."""
    return without_axis(spec, "pipe")


def _constrainer(state_plan: StatePlan, specs: Any, dtype) -> Callable[[Any], Any]:
    shardings = state_plan.named(specs)
    return lambda tree: jax.lax.with_sharding_constraint(
        jax.tree.map(lambda g: g.astype(dtype), tree), shardings)


def make_loss_and_grads(state_plan: StatePlan, model: ModelFns, hooks: Hooks,
                        options: StepOptions) -> Callable:
    """`(params, batch, scale, frozen, step) -> (metrics, grads)` for a
    layout (`frozen`: LoRA's base, None without; `step`: the optimizer
    step, which LoRA's dropout draws its masks from): pipelined
    over `pipe` through `options.schedule` if there is one, else
    accumulated over `options.microbatches`, reduced once per step
    (`options.reduce_once`) or once per microbatch. Gradients come out in
    the layout's gradient sharding and dtype. `batch` is what `weighted`
    takes, or gives."""
    constrain_grads = _constrainer(state_plan, state_plan.specs.grads, hooks.grad_dtype)
    microbatches = options.microbatches

    def strategy(model):
        if options.schedule is not None:
            return pipelined(state_plan, model, hooks, options, constrain_grads)
        if axes := unreduced_axes(state_plan, microbatches, options.reduce_once,
                                  runs_per_device(model, hooks)):
            return partial_sums(state_plan, model, hooks, microbatches, axes, constrain_grads)
        micro = NamedSharding(state_plan.mesh, PartitionSpec(None, *state_plan.batch_sharding.spec))
        return accumulated(functools.partial(lm_loss, model, hooks), microbatches,
                           constrain_grads, lambda x: jax.lax.with_sharding_constraint(x, micro))
    # A working copy narrower than the master weights is differentiated as
    # its exact float32 widening, so that gradients come out in float32 (and
    # are then cast to the gradient dtype), as they do from float32 parameters.
    widen = (master_lib.cast_to(jax.tree.map(lambda m: m.dtype, state_plan.master_params))
             if state_plan.master else lambda params: params)

    def loss_and_grads(params, batch, scale, frozen=None, step=None):
        # Under LoRA the base is closed over, not differentiated: no gradient
        # of it is computed or reduced; `step` seeds the adapters' dropout.
        fn = strategy(model if frozen is None else lora.bound(model, frozen, step))
        return fn(widen(params), weighted(batch), scale)
    return loss_and_grads


