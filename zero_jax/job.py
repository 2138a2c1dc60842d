"""A run config plus a model -> everything a run needs, built abstractly.

`prepare` resolves the mesh against the devices, validates the config,
chooses the layout, precision and remat policies, builds the optimizer and
the layout of the whole train state: all before anything is compiled or
allocated, so every error surfaces here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from zero_jax import config as config_lib
from zero_jax.precision import loss_scale, master, policies
from zero_jax.train import checks, grads, optim, state, step
from zero_jax.train.options import StepOptions
from zero_jax.model import exchange, grouped, lora, remat
from zero_jax.analysis import hlo, memory, traffic
from zero_jax.sharding import rules
from zero_jax.sharding import mesh as mesh_lib
from zero_jax.pipeline import executor as pipeline_executor
from zero_jax.pipeline import schedule as schedule_lib
from zero_jax.pipeline.cut import Stages, balanced
from zero_jax.sharding import zero as zero_lib
from zero_jax.checkpoint import sources
from zero_jax.context import split as context_split
from zero_jax.model.hooks import Hooks
from zero_jax.model.contract import ModelFns


@dataclasses.dataclass(frozen=True)
class Job:
    run: config_lib.RunConfig
    model: ModelFns
    state_plan: state.StatePlan
    tx: optax.GradientTransformation
    lr: optax.Schedule
    policy: policies.Policy
    hooks: Hooks
    scale_cfg: loss_scale.LossScaleConfig
    schedule: schedule_lib.Schedule | None = None  # the pipeline schedule, with a pipe axis
    notes: tuple[str, ...] = ()  # what the layout does differently from what was asked, and why

    @property
    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """What data.global_batch gives: tokens, each target's weight, and
        with --segment-ids each token's document within its row."""
        B, T = self.run.train.batch_size, self.run.data.seq_len
        sharding = self.state_plan.batch_sharding
        shapes = {"tokens": ((B, T + 1), jnp.int32), "weights": ((B, T), jnp.float32)}
        if self.run.data.segment_ids:
            shapes["segment_ids"] = ((B, T + 1), jnp.int32)
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for k, (shape, dtype) in shapes.items()}

    def lower_train_step(self):
        """The train step traced for the abstract state: the program every
        process must agree on before running it."""
        return self.jit_train_step().lower(self.state_plan.abstract, self.abstract_batch)

    def compile_train_step(self, **compiler_options):
        """The jitted train step, compiled ahead of time for the abstract state."""
        return self.lower_train_step().compile(compiler_options=compiler_options or None)

    @property
    def reduce_once(self) -> bool:
        """Gradients reduced once per optimizer step (else once per microbatch)."""
        return checks.resolve_grad_reduce(self.run.parallel.grad_reduce,
                                          self.state_plan.zero_stage) == "step"

    @property
    def step_options(self) -> StepOptions:
        """How this job's steps compute: microbatches, loss scaling, the
        pipeline and its options, when gradients are reduced, overlap."""
        par = self.run.parallel
        return StepOptions(microbatches=self.run.train.microbatches, loss_scale=self.scale_cfg,
                           schedule=self.schedule, gather_once=par.pipeline_gather_once,
                           reduce_once=self.reduce_once, tables_in_rows=self.tables_in_rows,
                           overlap=par.overlap_collectives)

    def jit_train_step(self):
        return step.jit_train_step(self.state_plan, self.model, self.hooks, self.tx, self.lr,
                                   self.step_options)

    def jit_loss_and_grads(self):
        """The step's loss and gradients alone, `(params, batch) -> (loss, grads)`:
        what tests compare between layouts and schedules. The gradients of a
        pipeline's layer stacks come back in layer order (as checkpoints hold them)."""
        fn = grads.make_loss_and_grads(self.state_plan, self.model, self.hooks, self.step_options)
        state_plan = self.state_plan
        replicated = jax.sharding.NamedSharding(state_plan.mesh, jax.sharding.PartitionSpec())
        grads_out = state_plan.named(state_plan.specs.grads)
        if state_plan.stages is not None and not state_plan.stages.identity:
            grads_out = jax.tree.map(lambda t: t.sharding, state_plan.targets.params)

        def loss_and_grads(params, batch):
            metrics, g = fn(params, batch, None)
            return metrics["loss"], state_plan.unpad_params(g)

        return jax.jit(loss_and_grads,
                       in_shardings=(state_plan.shardings.params, state_plan.batch_sharding),
                       out_shardings=(replicated, grads_out))

    def compile_eval_step(self):
        fn = step.jit_eval_step(self.state_plan, self.model, self.hooks, self.step_options)
        return fn.lower(self.state_plan.model_abstract, self.abstract_batch).compile()

    @property
    def tables_in_rows(self) -> bool:
        """A pipeline's loops use the tables in the row blocks they are
        stored in, where they are (`--pipeline-tables rows`)."""
        return self.run.parallel.pipeline_tables == "rows"

    def row_tables(self) -> list[bool]:
        """Per parameter, in the order of the params tree: a table a
        pipeline's loops can use in its row blocks over `pipe`, where it is
        stored (executor.row_tables); none without a pipeline."""
        fns = self.model.pipeline
        if self.schedule is None:
            return [False] * len(jax.tree.leaves(self.state_plan.abstract.params))
        outer, stack = fns.split(self.state_plan.abstract.params)
        stored, _ = fns.split(self.state_plan.specs.params)
        names, _ = fns.split(self.state_plan.names)
        rows = pipeline_executor.row_tables(fns, outer, stored, names)
        return jax.tree.leaves(fns.merge(rows, jax.tree.map(lambda _: False, stack)))

    def row_blocks(self) -> list[bool]:
        """`row_tables` where the loops use them so (`--pipeline-tables rows`), else none."""
        rows = self.row_tables()
        return rows if self.tables_in_rows else [False] * len(rows)

    @property
    def sequence_parallel(self) -> bool:
        return "tensor" in self.state_plan.rules.mesh_axes("res_seq")

    def activation_estimate(self) -> float | None:
        """The model's analytic activation bytes per device for one microbatch."""
        if self.model.activation_bytes is None:
            return None
        t, sizes = self.run.train, self.state_plan.mesh_shape.sizes
        rows = t.batch_size // t.microbatches // self.state_plan.data_parallel_size
        ctx = self.hooks.context
        return self.model.activation_bytes(rows, self.run.data.seq_len,
                                           jnp.dtype(self.policy.compute).itemsize,
                                           self.hooks.remat, sizes["tensor"], self.sequence_parallel,
                                           self.hooks.attention, ctx.size if ctx else 1,
                                           ctx.strategy if ctx else "", expert=sizes["expert"])

    def compile_with_text(self):
        """The compiled train step and its HLO after SPMD partitioning (what
        `collectives` measures), from one compile."""
        return hlo.compile_partitioned(self.lower_train_step())

    def collectives(self, partitioned_text: str, compiled_step=None) -> traffic.CollectiveReport:
        """Collective payload bytes per device per step, measured and in theory."""
        measured = traffic.traffic(partitioned_text, self.state_plan.mesh)
        expected = traffic.theory(self.state_plan, self.run.train.microbatches, self.reduce_once,
                                  self.policy.dtype("compute"), self.model.gathered_once,
                                  traffic.quantized_of(self.hooks, self.state_plan, self.model))
        backend = (None if compiled_step is None
                   else traffic.traffic(compiled_step.as_text(), self.state_plan.mesh).total)
        return traffic.CollectiveReport(measured, expected, backend)

    def memory_report(self, compiled_step=None,
                      partitioned_text: str | None = None) -> memory.MemoryReport:
        collectives = (None if partitioned_text is None
                       else self.collectives(partitioned_text, compiled_step))
        return memory.report(self.state_plan, compiled_step, self.activation_estimate(), collectives)

    def init_state(self, base: Any = None) -> state.TrainState:
        """A fresh state; under LoRA around `base`, the frozen base as stored
        (weights.base: `base_job`'s weights placed and cast, or quantized)."""
        return state.init_state(self.state_plan, self.model, self.tx,
                                jax.random.key(self.run.train.seed), self.scale_cfg,
                                self.policy.dtype("params"), base)

    def base_job(self) -> "Job":
        """Under LoRA, this job with the frozen base as its parameters, in the
        parameters' dtype: what a model's weights are loaded through (they
        are cast to the base's own dtype after)."""
        return dataclasses.replace(
            self, state_plan=self.state_plan.base_plan(self.policy.dtype("params")))

    def state_from_params(self, params) -> state.TrainState:
        return state.state_from_params(self.state_plan, self.tx, params, self.scale_cfg)


def mesh_config(run: config_lib.RunConfig) -> mesh_lib.MeshConfig:
    cfg = mesh_lib.load(run.parallel.mesh)
    if run.parallel.zero_shard_axes:
        axes = tuple(a.strip() for a in run.parallel.zero_shard_axes.split(",") if a.strip())
        cfg = dataclasses.replace(cfg, zero_shard_axes=axes)
    return cfg


def precision_policy(run: config_lib.RunConfig, platform: str) -> policies.Policy:
    p = run.precision
    return policies.resolve(p.policy, platform, params=p.param_dtype, compute=p.compute_dtype,
                             grads=p.grad_dtype, opt_state=p.opt_state_dtype)


def prepare(run: config_lib.RunConfig, build_model: Callable[[int], ModelFns],
            devices: Sequence[jax.Device] | None = None) -> Job:
    """Everything for `run`; `build_model(vocab_multiple)` makes the model."""
    mesh, shape = mesh_lib.build_mesh(mesh_config(run), devices)
    return prepare_on(run, build_model, mesh, shape)


def prepare_on(run: config_lib.RunConfig, build_model: Callable[[int], ModelFns], mesh,
               shape: mesh_lib.MeshShape) -> Job:
    """`prepare` on a given mesh: a device Mesh, or a jax.sharding.AbstractMesh
    of any size (shapes and shardings only: what a planner needs)."""
    config_lib.validate(run, {a: shape.sizes[a] for a in mesh_lib.DATA_AXES})
    sources.check_init_from(run.checkpoint.init_from)
    model = build_model(run.model.vocab_multiple)
    adapters = checks.lora_of(run, shape.sizes["pipe"])
    model = _asked_parameters(model, run, adapters)
    if model.max_seq_len is not None and run.data.seq_len > model.max_seq_len:
        raise config_lib.ConfigError(
            f"--seq-len {run.data.seq_len} exceeds the model's {model.max_seq_len} positions "
            f"({run.model.name}); use --seq-len {model.max_seq_len} or less, or give a model "
            f"trained from scratch that many with --max-seq-len {run.data.seq_len}")
    checks.check_experts(model, shape.sizes, run.parallel.grad_reduce)
    schedule, cut = pipeline_schedule(run, model, shape)
    chosen = rules.preset(run.parallel.layout, shape.sizes)
    axis_rules, notes = unsplit_where_indivisible(chosen.rules, model, shape.sizes)
    zero_stage = chosen.zero_stage if run.parallel.zero_stage is None else run.parallel.zero_stage
    checks.check_combination(run, zero_stage, shape, pipelined=schedule is not None)
    platform = "gpu" if isinstance(mesh, jax.sharding.AbstractMesh) else \
        mesh.devices.flat[0].platform
    try:
        policy = precision_policy(run, platform)
        remat_policy = remat.Remat(run.activations.remat,
                                   remat.parse_names(run.activations.save_names))
        attention = attention_implementation(run.model.attention, platform, policy.compute,
                                             run.data.segment_ids)
        experts = dict(expert_gemm=grouped.resolve(run.model.expert_gemm), **exchange.resolve_all(
            run.model.expert_exchange, run.model.expert_dispatch, platform, *shape.split("expert")))
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    lr = optim.schedule(run.optim, run.train.steps)
    tx = policies.with_state_dtype(optim.optimizer(run.optim, lr, model.decay_mask),
                                    policy.dtype("opt_state"))
    if state.needs_master(zero_stage, policy.dtype("params"), policy.dtype("compute"),
                          adapters=adapters is not None):
        tx = master.wrap(tx)
    layout = rules.Preset(axis_rules, zero_stage)  # the preset, as resolved for this mesh
    # Offload moves states to host memory without changing how they are split.
    state_plan = dataclasses.replace(
        state.plan_state(model, tx, mesh, shape, layout, policy, run.parallel.min_shard_elements,
                         cut),
        host_opt=run.offload.optimizer, host_params=run.offload.params)
    checks.adapters_found(run, adapters, state_plan.frozen_names is not None)
    if adapters:  # the base's weight gradients are not computed: its FLOPs say so
        model = dataclasses.replace(model, flops_per_token=lora.flops_per_token(
            model.flops_per_token, memory.trained_count(state_plan)))
    stored = state_plan.placement if zero_lib.stage(zero_stage).params else None
    hooks = Hooks(mesh, axis_rules, policy.compute, policy.grads, remat_policy, stored,
                  host_params=run.offload.params, attention=attention, scan_layers=run.model.scan_layers,
                  fp8=run.precision.fp8 if policy.fp8 else "", fp8_history=run.precision.fp8_history,
                  int8_gather_block=run.zero.block_size if run.zero.quantized_weights else 0,
                  int8_reduce_block=run.zero.block_size if run.zero.quantized_grads else 0, **experts,
                  lora=adapters,
                  context=context_split.of_run(run, getattr(model.config, "n_head", 0), shape.sizes, attention,
                                        pipelined=schedule is not None))
    return Job(run, model, state_plan, tx, lr, policy, hooks, loss_scale_config(run, policy),
               schedule, notes)


def _asked_parameters(model: ModelFns, run: config_lib.RunConfig, adapters) -> ModelFns:
    """`model` initialising the parameters its hooks ask for: delayed FP8's
    amax histories, LoRA's adapters (`adapters`, which it records)."""
    delayed = run.precision.policy == "fp8" and run.precision.fp8 == "delayed"
    if not (delayed or adapters):
        return model
    return dataclasses.replace(model, init=functools.partial(model.init, hooks=Hooks(
        fp8="delayed" if delayed else "", fp8_history=run.precision.fp8_history,
        lora=adapters)), lora=adapters)


def loss_scale_config(run: config_lib.RunConfig, policy: policies.Policy
                      ) -> loss_scale.LossScaleConfig:
    """DeepSpeed's loss-scaling knobs from [precision]; scaling is on where the policy needs it."""
    p = run.precision
    return loss_scale.LossScaleConfig(
        enabled=policy.needs_loss_scaling, initial_scale_power=p.initial_scale_power,
        window=p.loss_scale_window, hysteresis=p.hysteresis, min_scale=p.min_loss_scale,
        max_consecutive_skips=p.max_consecutive_skips)


def unsplit_where_indivisible(axis_rules: rules.AxisRules, model: ModelFns,
                              sizes: dict[str, int]) -> tuple[rules.AxisRules, tuple[str, ...]]:
    """The rules with each of the model's replicable axes (ModelFns.replicable)
    left unsplit where its mesh axes do not divide it, and a note for each:
    2 key/value heads on tensor=4 are replicated within the tensor group
    (each device computes the heads its query heads read), not refused."""
    notes = []
    for name, size in model.replicable.items():
        axes = [a for a in axis_rules.mesh_axes(name) if sizes.get(a, 1) > 1]
        split = math.prod(sizes[a] for a in axes)
        if size % split:
            axis_rules = axis_rules.replace(**{name: ()})
            notes.append(f"{name}: {size} not divisible by {'*'.join(axes)}={split}, so "
                         f"replicated within each {'*'.join(axes)} group")
    return axis_rules, tuple(notes)


def attention_implementation(choice: str, platform: str, compute_dtype: str,
                             segments: bool = False) -> str:
    """`jax.nn.dot_product_attention`'s implementation for `choice`: auto is
    cuDNN's fused kernel on a GPU computing in 16 bits (it takes no float32),
    XLA's elsewhere and with document masking (`segments`), which only the
    XLA computation here applies."""
    if choice == "auto":
        sixteen = jnp.dtype(compute_dtype).itemsize == 2
        return "cudnn" if platform == "gpu" and sixteen and not segments else "xla"
    if choice == "cudnn" and segments:
        raise config_lib.ConfigError("--attention cudnn with --segment-ids: document masking is "
                                     "applied by the xla implementation only; use --attention xla "
                                     "(or auto)")
    if choice == "cudnn" and platform != "gpu":
        raise config_lib.ConfigError(f"--attention cudnn on {platform}: cuDNN runs on NVIDIA "
                                     "GPUs only; use --attention xla (or auto)")
    return choice


def pipeline_schedule(run: config_lib.RunConfig, model: ModelFns, shape: mesh_lib.MeshShape
                      ) -> tuple[schedule_lib.Schedule | None, Stages | None]:
    """The schedule table and the stack's cut for a pipe axis; checks before compiling."""
    p = shape.sizes["pipe"]
    if p == 1:
        return None, None
    par, why = run.parallel, (": its multi-token prediction follows the head, which no stage "
                              "runs; use --mtp-depth 0, or pipe=1") if model.mtp_depth else ""
    if model.pipeline is None:
        raise config_lib.ConfigError(f"model {run.model.name} cannot be pipelined (pipe={p}){why}")
    v = par.virtual_stages or (2 if par.pipeline_schedule == "interleaved" else 1)
    try:
        schedule_lib.check_shape(par.pipeline_schedule, p, run.train.microbatches, v)
        cut = balanced(model.layers, p, v)
    except ValueError as e:
        raise config_lib.ConfigError(f"pipe={p}: {e}") from None
    return schedule_lib.build(par.pipeline_schedule, p, run.train.microbatches, v), cut
