"""The bytes per device of one training step of a layout.

The model states as stored (params, grads, opt_state) are exact, from the
layout's shardings (memory.sharded), and so is which of them live in host
memory (its memory kinds). What a step adds to them is estimated: its
temporaries peak in one of three phases, whose buffers XLA reuses for one
another (activations are dead when the optimizer runs):

  backward   gradient buffers, the activations the remat policy keeps and
             rebuilds, gathered ZeRO-3 weights (a pipeline: its stashed
             stage inputs and one chunk's);
  reduction  partial sums reduced into the gradients' sharded layout;
  update     the gradients and the optimizer's working copies.

Within the backward pass the head's and a layer's working sets are never
live together: the larger counts. XLA:CPU copies the donated optimizer
state at the start of the program (the update selects between old and new
values, for skipped steps) and holds the copy throughout; a GPU's
memory-aware scheduler makes it at the update. `platform="cpu"` counts
that copy, and XLA:CPU's reduce-scatter, to compare with programs compiled
here.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from zero_jax import job as job_lib
from zero_jax.model import remat as remat_lib
from zero_jax.analysis import memory
from zero_jax.pipeline import weight_grad
from zero_jax.planner.choices import Choice, pipeline_schedule
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.specs import (bytes_per_device, leaf_bytes, map_specs, shard_elements,
                                     spec_leaves, without_axis)


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes per device of a layout's states and of each phase of its step."""

    state: dict[str, int]  # params, grads, opt_state as stored (memory.sharded)
    host: dict[str, int]  # of `state`, in host memory (memory.by_memory_kind)
    backward: float  # the backward pass's temporaries
    reduction: float  # reducing partial sums into a sharded layout (0: no such phase)
    update: float  # the optimizer's update
    host_step: float = 0.0  # host bytes a step adds: the gradient shard the update reads

    @property
    def phases(self) -> dict[str, float]:
        """The temporaries of each phase of a step; the largest counts."""
        return {"backward": self.backward, "reduction": self.reduction, "update": self.update}

    @property
    def device_bytes(self) -> float:
        """Device bytes: the parameters and optimizer state left on the device,
        and the largest phase (which counts the gradients' buffers)."""
        stored = sum(self.state[k] - self.host.get(k, 0) for k in ("params", "opt_state"))
        return stored + max(self.phases.values())

    @property
    def host_bytes(self) -> float:
        """Host memory this device uses: its offloaded states and the update's gradients."""
        return sum(self.host.values()) + self.host_step


def step_bytes(job: job_lib.Job, choice: Choice, platform: str = "gpu") -> StepBytes:
    """The states and phase temporaries of `choice`, with `job` the abstract
    job of its mesh, ZeRO stage and stage cut."""
    state_plan = job.state_plan
    state = memory.sharded(state_plan)
    split = memory.by_memory_kind(state_plan)
    stage = zero_lib.stage(choice.zero)
    held = split["device"]["opt_state"] if platform == "cpu" else 0.0  # XLA:CPU's early copy
    per_microbatch = reduces_each_microbatch(job, stage)
    backward = _backward(job, choice, state, per_microbatch) + held
    reduction = (_reduction(state_plan, state, platform) + held
                 if (stage.grads and not per_microbatch) else 0.0)
    _, g = dtype_bytes(job)
    host_step = update_elements(state_plan, stage) * g if state_plan.host_opt else 0.0
    return StepBytes(state, split["host"], backward, reduction,
                     _update(state_plan, stage, state, split), host_step)


def dtype_bytes(job: job_lib.Job) -> tuple[int, int]:
    """Bytes per element of the activations (the compute dtype) and of the gradients."""
    return (np.dtype(job.policy.dtype("compute")).itemsize,
            np.dtype(job.state_plan.grad_dtype).itemsize)


def reduces_each_microbatch(job: job_lib.Job, stage: zero_lib.ZeroStage) -> bool:
    """ZeRO-3 gradients reduced into their shards after every microbatch
    rather than summed whole and reduced once per step (job.reduce_once)."""
    return stage.params and not job.reduce_once


def compute_grad_bytes(state_plan) -> int:
    """Bytes per device of the gradients in the compute layout: what a
    device's backward pass produces before any reduction."""
    return bytes_per_device(state_plan.abstract_grads, state_plan.specs.compute, state_plan.mesh)


def frozen_bytes(state_plan) -> tuple[float, float]:
    """LoRA's frozen base, bytes per device in its compute layout, as ZeRO-3
    gathers it (a quantized weight's codes and scales as stored): (outside
    the layer stack, the stack). (0, 0) without LoRA."""
    out = [0.0, 0.0]
    if state_plan.abstract.frozen is None:
        return 0.0, 0.0
    for size, names in zip(leaf_bytes(state_plan.abstract.frozen, state_plan.frozen_compute_specs,
                                      state_plan.mesh), spec_leaves(state_plan.frozen_names)):
        out[bool(len(names)) and names[0] == "layers"] += size
    return out[0], out[1]


def update_elements(state_plan, stage: zero_lib.ZeroStage) -> float:
    """Parameters this device updates: its shard in the optimizer's layout."""
    specs = state_plan.specs.sharded if stage.opt_state else state_plan.specs.params
    f32 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, np.float32), state_plan.abstract.params)
    return bytes_per_device(f32, specs, state_plan.mesh) / 4


def _backward(job: job_lib.Job, choice: Choice, state: dict[str, int],
              per_microbatch: bool) -> float:
    """The backward pass's peak: a pipeline's, ZeRO-3's reduced per
    microbatch, or that of full-size partial sums."""
    acts = _activations(job, choice)
    gathers = _layer_gathers(job, choice)
    if choice.pipe > 1:
        return _pipeline_backward(job, choice, acts, gathers, per_microbatch)
    if per_microbatch:
        return _reduced_backward(job, choice, state, acts, gathers)
    return _partial_sums_backward(job, choice, acts, gathers)


def _activations(job: job_lib.Job, choice: Choice):
    """One microbatch's activation parts (the model's activation_parts).
    In a pipeline a backward tick rebuilds one chunk's layers (its slots);
    the last stage's forward tick runs the head, whose logits it holds whole."""
    cfg = job.model.config
    if choice.pipe > 1:
        cfg = dataclasses.replace(cfg, n_layer=job.state_plan.stages.slots)
    c, _ = dtype_bytes(job)
    ctx, remat = job.hooks.context, remat_lib.Remat(choice.remat)
    parts = cfg.activation_parts(choice.micro, job.run.data.seq_len, c, remat,
                                 choice.tensor, job.sequence_parallel, job.hooks.attention,
                                 choice.context, ctx.strategy if ctx else "")
    if not hasattr(cfg, "dispatch_parts"):  # a family without experts
        return parts
    # A mixture's dispatch buffers over `expert`, sized for the worst case.
    extra = cfg.dispatch_parts(choice.micro, job.run.data.seq_len, c, remat, choice.expert,
                               choice.tensor, choice.context)
    return parts.plus(extra)


def _layers_here(job: job_lib.Job, choice: Choice) -> int:
    """Layers of the stack one device runs: its stage's slots in a pipeline."""
    return job.state_plan.stages.padded // choice.pipe if choice.pipe > 1 else max(job.model.layers, 1)


def _per_layer(job: job_lib.Job, choice: Choice) -> float:
    """One layer's gradient bytes in the compute layout."""
    _, stack = _split_bytes(job.state_plan, job.state_plan.abstract_grads, job.state_plan.specs.compute)
    return stack / _layers_here(job, choice)


def _layer_gathers(job: job_lib.Job, choice: Choice) -> float:
    """ZeRO-3's gathered weights, this layer's and the next (prefetched);
    with parameter offload, their stored shards fetched from host memory too."""
    state_plan = job.state_plan
    c, g = dtype_bytes(job)
    gathers = 0.0
    if zero_lib.stage(choice.zero).params:  # the trained parameters, and LoRA's frozen base
        gathers = 2 * (_per_layer(job, choice) / g * c
                       + frozen_bytes(state_plan)[1] / _layers_here(job, choice))
    if state_plan.host_params:
        _, stack_stored = _split_bytes(state_plan, state_plan.abstract.params, state_plan.specs.params)
        gathers += 2 * stack_stored / _layers_here(job, choice)
    return gathers


def _pipeline_backward(job: job_lib.Job, choice: Choice, acts, gathers: float,
                       per_microbatch: bool) -> float:
    """Throughout: accumulators in the gradient layout (reduced each
    microbatch) or the compute layout (partial sums), `pipe` left out for
    the embedding and head, which are gathered whole for the step, except
    for the tables the loop uses in their row blocks (`tables_in_blocks`); the
    stash. A forward tick of the last stage adds the head (with row blocks:
    every stage, its block of the logits) and the embedding's and head's
    gradient; a backward tick the rebuilt chunk, its gradients and its
    layers' gathers. They are branches of one switch: never live together."""
    state_plan, cfg = job.state_plan, job.model.config
    c, g = dtype_bytes(job)
    schedule = pipeline_schedule(choice)
    act = choice.micro * job.run.data.seq_len * cfg.d_model * c
    # Per stage, its stash and (split backward) its waiting Ws: each holds
    # every product's input and output gradient (16 d_model per token and
    # layer for a GPT block), split over tensor. The two peak on opposite
    # ends of the pipeline (stash on the first stage, Ws on the last).
    waiting = (schedule.pending_w_peak() if schedule.split_backward else [0] * choice.pipe)
    per_w = 0.0
    if schedule.split_backward:
        per_w = (job.state_plan.stages.slots * _kept_per_token(job) / cfg.d_model * act
                 / choice.tensor)
    stash = max(s * act + w * per_w for s, w in zip(schedule.stash_peak(), waiting))
    specs = state_plan.specs.grads if per_microbatch else state_plan.specs.compute
    rows = tables_in_blocks(job, choice)
    outer_acc = _outer_here(state_plan, map_specs(lambda sp: without_axis(sp, "pipe"), specs), rows,
                            choice.pipe)
    _, stack_acc = _split_bytes(state_plan, state_plan.abstract_grads, specs)
    outer_grads = _outer_here(state_plan, state_plan.specs.compute, rows, choice.pipe)
    base = outer_acc + stack_acc + outer_grads / g * c + stash
    forward = acts.head / (choice.pipe if any(rows) else 1) + outer_grads
    backward_tick = acts.kept + acts.rebuilt + stack_acc / choice.virtual + gathers
    return base + max(forward, backward_tick)


def tables_in_blocks(job: job_lib.Job, choice: Choice) -> list[bool]:
    """Per parameter: a table the loops of `choice` use in its row blocks
    over `pipe` (`choice.tables`; `job` may be another choice's of the
    same mesh)."""
    rows = job.row_tables()
    return rows if choice.tables == "rows" else [False] * len(rows)


def _outer_here(state_plan, specs, rows: list[bool], p: int) -> float:
    """Gradient bytes per device of the parameters outside the stack laid out
    by `specs` (`pipe` left out), a table used in row blocks a `p`-th."""
    sizes = leaf_bytes(state_plan.abstract_grads, specs, state_plan.mesh)
    return sum(size / (p if row else 1)
               for size, stacked, row in zip(sizes, jax.tree.leaves(state_plan.stacked[0]), rows)
               if not stacked)


def _reduced_backward(job: job_lib.Job, choice: Choice, state: dict[str, int], acts,
                      gathers: float) -> float:
    """ZeRO-3 reduced on the spot: the gradient shard and one layer's full
    gradient; the parameters gathered once (tied embeddings) keep their
    gradient per batch shard."""
    c, g = dtype_bytes(job)
    tied = _gathered_once(job.state_plan, job.model)
    base = state["grads"] + acts.kept + tied * c
    layer = acts.rebuilt + tied * g + 2 * _per_layer(job, choice) + gathers
    return base + max(acts.head, layer)


def _partial_sums_backward(job: job_lib.Job, choice: Choice, acts, gathers: float) -> float:
    """Full-size partial sums in the compute layout, and with several
    microbatches the microbatch's own gradients beside them."""
    base = compute_grad_bytes(job.state_plan) * (2 if choice.microbatches > 1 else 1) + acts.kept
    return base + max(acts.head, acts.rebuilt + gathers)


def _reduction(state_plan, state: dict[str, int], platform: str) -> float:
    """Reducing partial sums into a sharded layout: a reduce-scatter, which
    XLA:CPU lowers to an all-reduce (a full-size result) and a slice, one
    array at a time: the partial sums and the largest array's result."""
    result = (_largest(state_plan, state_plan.abstract_grads, state_plan.specs.compute)
              if platform == "cpu" else state["grads"])
    return compute_grad_bytes(state_plan) + result


def _update(state_plan, stage: zero_lib.ZeroStage, state: dict[str, int],
            split: dict[str, dict[str, int]]) -> float:
    """The gradients, two float32 working copies of the parameters in the
    optimizer's layout (new moments before they replace the donated ones),
    and, with a replicated working copy, the gathered new parameters. Run on
    the host (offload.py), the device holds the gradients it sends and the
    new parameters that come back beside the old; offloaded parameters alone
    are fetched whole for an update on the device."""
    if state_plan.host_opt:
        return state["grads"] + split["device"]["params"]
    working = state["params"] if stage.opt_state and not stage.params else 0.0
    return state["grads"] + 8 * update_elements(state_plan, stage) + working + split["host"]["params"]


def _split_bytes(state_plan, abstract, specs) -> tuple[float, float]:
    """Bytes per device of `abstract` laid out by `specs`: (outside the layer stack, the stack)."""
    out = [0.0, 0.0]
    for size, stacked in zip(leaf_bytes(abstract, specs, state_plan.mesh),
                             jax.tree.leaves(state_plan.stacked[0])):
        out[bool(stacked)] += size
    return out[0], out[1]


def _largest(state_plan, abstract, specs) -> float:
    """Bytes per device of the largest array of `abstract` laid out by `specs`."""
    return max(leaf_bytes(abstract, specs, state_plan.mesh))


def _gathered_once(state_plan, model) -> float:
    """Elements a device holds of the parameters the model gathers once (ZeRO-3)."""
    return float(sum(
        shard_elements(leaf.shape, jax.sharding.NamedSharding(state_plan.mesh, spec))
        for key in model.gathered_once
        for leaf, spec in zip(jax.tree.leaves(state_plan.abstract.params.get(key, {})),
                              spec_leaves(state_plan.specs.compute.get(key, {})))))


_KEPT: dict = {}


def _kept_per_token(job: job_lib.Job) -> int:
    """weight_grad.kept_per_token of the job's model, once per model shape."""
    cfg = job.model.config
    if cfg not in _KEPT:
        fns = job.model.pipeline
        _, stack = fns.split(job.state_plan.abstract.params)
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), stack)
        # Shapes only, traced here: the products are the same under any
        # attention kernel, and cuDNN's cannot be traced without a GPU.
        hooks = dataclasses.replace(job.hooks, attention="xla")
        _KEPT[cfg] = weight_grad.kept_per_token(fns.stage, layer, cfg.d_model,
                                                hooks.dtype, hooks)
    return _KEPT[cfg]
