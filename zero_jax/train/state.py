"""The train state, built abstract first: shapes -> shardings -> sharded init.

Nothing is materialised before its sharding is known: `plan_state` works on
`jax.eval_shape` results only, so the memory report, the plan and checkpoint
restore can use it for models that would not fit on this machine, and
`init_state` creates every array directly in its final layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zero_jax.model import base_quant, lora
from zero_jax.precision import loss_scale as loss_scale_lib
from zero_jax.precision import master as master_lib
from zero_jax.sharding import offload as offload_lib
from zero_jax.precision import policies
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.mesh import DATA_AXES, MeshShape
from zero_jax.model.contract import ModelFns
from zero_jax.sharding.rules import AxisRules, Preset
from zero_jax.sharding.specs import entries, entry_axes, map_specs, path_name
from zero_jax.pipeline.cut import Stages


class TrainState(NamedTuple):
    step: Any  # int32 scalar: steps taken (batches consumed, skipped steps included)
    params: Any  # parameter tree: the master weights, or the working copy (master.py)
    opt_state: Any  # optax state (master.MasterState around it with a working copy)
    loss_scale: Any  # loss_scale.LossScale: scale and skip counters (replicated scalars)
    # Under LoRA, the frozen base (every parameter but the adapters, which
    # are `params`), in the compute dtype; never updated. None: no LoRA.
    frozen: Any = None

    @property
    def model_params(self) -> Any:
        """The parameters the model runs with: `params`, with the frozen base."""
        return self.params if self.frozen is None else lora.merge(self.params, self.frozen)


def saved_form(state: TrainState) -> TrainState:
    """The state as checkpoints hold it, the same under every layout: the
    master weights as `params` and the optimizer's own state, with no
    working copy (it is cast from the master weights again on restore),
    and no frozen base (it is read from where it came from)."""
    if isinstance(state.opt_state, master_lib.MasterState):
        return TrainState(state.step, state.opt_state.master, state.opt_state.inner,
                          state.loss_scale)
    return state._replace(frozen=None)


def logical_names(boxed_params: Any) -> Any:
    """Tree of PartitionSpecs of logical names (None for unannotated dims)."""

    def names(leaf):
        if isinstance(leaf, meta.AxisMetadata) and hasattr(leaf, "names"):
            return PartitionSpec(*leaf.names)
        return PartitionSpec(*(None,) * len(leaf.shape))

    return jax.tree.map(names, boxed_params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """Where every piece of the train state lives, for one mesh and stage."""

    mesh: Mesh
    mesh_shape: MeshShape
    rules: AxisRules
    zero_stage: int
    abstract: TrainState  # jax.ShapeDtypeStruct leaves
    names: Any  # params tree of logical-name PartitionSpecs
    specs: zero_lib.StateSpecs  # storage and compute specs
    placement: zero_lib.Placement  # the ZeRO split (used again at each parameter's use)
    grad_dtype: Any  # gradients are held (and accumulated) in this dtype
    master: bool = False  # params are a working copy; float32 masters live in the optimizer state
    stages: Stages | None = None  # a pipeline's cut: stacked leaves stored in its slots
    stacked: Any = None  # (params, opt_state) trees of bools: the leaf is a layer stack
    host_opt: bool = False  # the optimizer state (and masters) live in host memory (offload.py)
    host_params: bool = False  # the stored parameters (ZeRO-3 shards) live in host memory
    # Under LoRA (the frozen base in abstract.frozen): its logical names, storage and compute specs
    frozen_names: Any = None
    frozen_specs: Any = None
    frozen_compute_specs: Any = None

    @property
    def master_params(self) -> Any:
        """Abstract master weights: `params`, or the copy in the optimizer state."""
        return self.abstract.opt_state.master if self.master else self.abstract.params

    @property
    def master_specs(self) -> Any:
        return self.specs.opt_state.master if self.master else self.specs.params

    @property
    def abstract_grads(self) -> Any:
        return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, self.grad_dtype),
                            self.abstract.params)

    @property
    def state_specs(self) -> TrainState:
        scalars = jax.tree.map(lambda _: PartitionSpec(), self.abstract.loss_scale)
        return TrainState(PartitionSpec(), self.specs.params, self.specs.opt_state, scalars,
                          self.frozen_specs)

    def named(self, specs: Any) -> Any:
        return map_specs(lambda s: NamedSharding(self.mesh, s), specs)

    @property
    def shardings(self) -> TrainState:
        """Where each leaf of the state is stored: the optimizer state and the
        parameters in host memory where they are offloaded (offload.py), the
        rest on the device."""
        out = self.named(self.state_specs)
        if self.host_opt:
            out = out._replace(opt_state=offload_lib.on_host(out.opt_state))
        if self.host_params:
            out = out._replace(params=offload_lib.on_host(out.params),
                               frozen=offload_lib.on_host(out.frozen))
        return out

    @property
    def model_shardings(self) -> Any:
        """Where the parameters the model runs with are (TrainState.model_params)."""
        return self.shardings.model_params

    @property
    def model_abstract(self) -> Any:
        return self.abstract.model_params

    @property
    def targets(self) -> TrainState:
        """The abstract saved form (`saved_form`) with its shardings: what a
        restore fills in. A layer stack is restored in layer order; where its
        length does not split over the mesh axes of its slot dimension, it
        is read whole along that dimension and then cut into the slots."""
        def target(a, s, stacked):
            if not (stacked and self.stages):
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            shape = (self.stages.layers,) + a.shape[1:]
            spec = entries(s.spec, len(shape))
            if shape[0] % math.prod(self.mesh_shape.sizes[a] for a in entry_axes(spec[0])):
                spec[0] = None
            return jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(self.mesh,
                                                                               PartitionSpec(*spec)))
        return self.saved_form(jax.tree.map(target, self.abstract, self.shardings,
                                            self._stacked_state()), abstract=True)

    def _stacked_state(self) -> TrainState:
        params, opt = self.stacked if self.stacked is not None else (None, None)
        def no(tree):
            return jax.tree.map(lambda _: False, tree)
        return TrainState(False, params if params is not None else no(self.abstract.params),
                          opt if opt is not None else no(self.abstract.opt_state),
                          no(self.abstract.loss_scale), no(self.abstract.frozen))

    def saved_form(self, state: TrainState, abstract: bool = False) -> TrainState:
        """`saved_form(state)` with layer stacks in layer order, unpadded
        (one leaf at a time: the copy is never bigger than one leaf)."""
        if self.stages is not None and not self.stages.identity and not abstract:
            unpad = jax.jit(self.stages.unpad)
            state = jax.tree.map(lambda x, stacked: unpad(x) if stacked else x, state,
                                 self._stacked_state())
        return saved_form(state)

    @property
    def working_dtypes(self) -> Any:
        return jax.tree.map(lambda p: p.dtype, self.abstract.params)

    def to_working(self, master: Any) -> Any:
        """The working copy from master weights, cast shard by shard where the
        masters are sharded, so that gathering it moves the narrow dtype."""
        cast = master_lib.cast_to(self.working_dtypes)(master)
        return jax.lax.with_sharding_constraint(cast, self.named(self.master_specs))

    def from_saved(self, saved: TrainState, frozen: Any = None) -> TrainState:
        """A train state in this layout from its saved form (`saved_form`)
        and, under LoRA, the frozen base placed in this layout."""
        return self._from_saved(saved)._replace(frozen=frozen)

    def _from_saved(self, saved: TrainState) -> TrainState:
        if self.stages is not None and not self.stages.identity:
            def pad(x, stacked, spec):
                if not stacked:
                    return x
                return jax.jit(self.stages.pad, out_shardings=NamedSharding(self.mesh, spec))(x)
            saved = jax.tree.map(pad, saved, saved_form(self._stacked_state()),
                                 saved_form(self.state_specs))
        if not self.master:
            return saved
        # The masters may be in host memory (offload): cast on the device.
        masters = jax.device_put(saved.params, self.named(self.master_specs))
        params = jax.jit(self.to_working, out_shardings=self.shardings.params)(masters)
        return TrainState(saved.step, params, master_lib.MasterState(saved.params, saved.opt_state),
                          saved.loss_scale)

    def pad_params(self, params: Any) -> Any:
        """A parameter tree in layer order -> this layout's slots (traceable)."""
        if self.stages is None or self.stages.identity:
            return params
        return jax.tree.map(lambda x, st: self.stages.pad(x) if st else x, params, self.stacked[0])

    def unpad_params(self, params: Any) -> Any:
        """A parameter-shaped tree (parameters, gradients) in layer order (traceable)."""
        if self.stages is None or self.stages.identity:
            return params
        return jax.tree.map(lambda x, st: self.stages.unpad(x) if st else x, params,
                            self.stacked[0])

    def base_plan(self, dtype) -> "StatePlan":
        """Under LoRA, the frozen base as a plan of parameters alone, in
        `dtype` and its storage layout: what loading a model's weights into
        the base reads them as (`targets`, `master_params`)."""
        base = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype),
                            base_quant.full(self.abstract.frozen))
        no = jax.tree.map(lambda _: False, base)
        return dataclasses.replace(
            self, abstract=TrainState(self.abstract.step, base, (), self.abstract.loss_scale),
            names=base_quant.full(self.frozen_names), master=False, stacked=(no, ()),
            frozen_names=None, frozen_specs=None, frozen_compute_specs=None,
            specs=dataclasses.replace(self.specs, params=base_quant.full(self.frozen_specs),
                                      opt_state=()))

    def cast_base(self, base: Any) -> Any:
        """LoRA's base weights (read as `base_plan` lays them out) in the
        base's own dtype and layout, cast on the devices."""
        return jax.jit(functools.partial(base_quant.store, self.abstract.frozen),
                       out_shardings=self.shardings.frozen)(base)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The data-parallel mesh axes the batch is split over (size-1 ones left out)."""
        return tuple(a for a in DATA_AXES if self.mesh_shape.sizes[a] > 1)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Token batches (B, T): rows split over every data-parallel axis."""
        return NamedSharding(self.mesh, PartitionSpec(self.data_axes or None))

    @property
    def data_parallel_size(self) -> int:
        sizes = self.mesh_shape.sizes
        return math.prod(sizes[a] for a in DATA_AXES)


def init_params(model: ModelFns, key: jax.Array, param_dtype) -> Any:
    return policies.cast_tree(nn.unbox(model.init(key)), param_dtype)


def needs_master(zero_stage: int, param_dtype, compute_dtype, adapters: bool = False) -> bool:
    """Whether a working copy is stored apart from the master weights: where
    parameters are replicated but the optimizer state is sharded (stages 1
    and 2) and the model computes in a narrower dtype than it stores; never
    for LoRA's adapters, too small for a copy to matter."""
    if adapters:
        return False
    stage = zero_lib.stage(zero_stage)
    narrower = jnp.dtype(compute_dtype).itemsize < jnp.dtype(param_dtype).itemsize
    return stage.opt_state and not stage.params and narrower


def plan_state(model: ModelFns, tx: optax.GradientTransformation, mesh: Mesh,
               mesh_shape: MeshShape, layout: Preset, policy: policies.Policy,
               min_shard_elements: int = 4096, stages: Stages | None = None) -> StatePlan:
    """Abstract state and the specs of every leaf; raises ShardingError early.

    `layout`: the axis rules and ZeRO stage, as the job resolved them;
    `policy`: each state's dtype. With master weights (`needs_master`), `tx`
    must be wrapped by `master.wrap`: it is initialised with the float32
    parameters, and the stored parameters are the working copy in the
    dtypes the model uses them in. With `stages`, layer stacks (leaves
    whose first logical axis is `layers`) are stored in the pipeline's slots
    (pipeline/cut.py). The plan keeps every state on the device; host
    offload (`host_opt`, `host_params`) moves states, not their specs.
    """
    rules, zero_stage = layout.rules, layout.zero_stage
    param_dtype, compute_dtype = policy.dtype("params"), policy.dtype("compute")
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0)))  # traces the key too: no compile
    names = logical_names(boxed)
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0), param_dtype))
    names, params, frozen_names, frozen = base_quant.split_base(
        names, params, compute_dtype, model.lora, rules, mesh_shape.sizes)
    stacked_params = zero_lib.layer_stacks(names)
    compute_names = names
    if stages is not None:  # a stack the pipeline runs whole (dense layers before experts) is outer
        stacked_params = _pipeline_stack(model, stacked_params)
        compute_names = jax.tree.map(  # ... and its layers are not split over `pipe`
            lambda n, st: n if st or not len(n) or n[0] != "layers" else PartitionSpec(None, *n[1:]),
            names, stacked_params, is_leaf=lambda x: isinstance(x, PartitionSpec))
    master = needs_master(zero_stage, param_dtype, compute_dtype, adapters=frozen is not None)
    if master:  # traced in layer order, before any padding
        tokens = (1, min(8, model.max_seq_len or 8))
        dtypes = master_lib.use_dtypes(model.apply, params, names, jnp.dtype(compute_dtype).name,
                                       tokens, unused_dtype=param_dtype)
    if stages is not None:
        params = jax.tree.map(
            lambda p, st: jax.ShapeDtypeStruct((stages.padded,) + p.shape[1:], p.dtype) if st else p,
            params, stacked_params)
    opt_state = jax.eval_shape(tx.init, params)
    def is_abstract(x):
        return isinstance(x, jax.ShapeDtypeStruct)
    stacked_opt = optax.tree_map_params(
        tx, lambda leaf, p, st: bool(st and leaf.ndim and leaf.shape[0] == p.shape[0]),
        opt_state, params, stacked_params, transform_non_params=lambda _: False, is_leaf=is_abstract)
    if master:
        params = jax.tree.map(lambda p, d: jax.ShapeDtypeStruct(p.shape, d), params, dtypes)
    scale = jax.eval_shape(lambda: loss_scale_lib.init(loss_scale_lib.LossScaleConfig()))
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, scale, frozen)
    sizes = mesh_shape.sizes
    compute = _compute_specs(rules, sizes, params, compute_names)
    placement = zero_lib.Placement.on(mesh_shape, min_shard_elements)
    over_pipe = zero_lib.PipeSplit(zero_lib.Placement(("pipe",), sizes["pipe"], min_shard_elements),
                                   dict(sizes), stacked_params) if stages is not None else None
    specs = zero_lib.state_specs(params, compute, names, opt_state, tx,
                                 zero_lib.stage(zero_stage), placement, over_pipe)
    frozen_compute, frozen_specs = _frozen_specs(frozen, frozen_names, rules, sizes,
                                                 zero_lib.stage(zero_stage), placement)
    return StatePlan(mesh, mesh_shape, rules, zero_stage, abstract, names, specs, placement,
                     jnp.dtype(policy.dtype("grads")), master, stages,
                     (stacked_params, stacked_opt), frozen_names=frozen_names,
                     frozen_specs=frozen_specs, frozen_compute_specs=frozen_compute)


def _frozen_specs(frozen: Any, names: Any, rules: AxisRules, sizes: dict,
                  zero: zero_lib.ZeroStage, placement: zero_lib.Placement) -> tuple[Any, Any]:
    """LoRA's frozen base's (compute, storage) specs; (None, None) without."""
    if frozen is None:
        return None, None
    compute = _compute_specs(rules, sizes, frozen, names)
    return compute, zero_lib.stored_specs(frozen, compute, names, zero, placement)


def _compute_specs(rules: AxisRules, sizes: dict, params: Any, names: Any) -> Any:
    """Each parameter's layout for use, by the rules (no ZeRO split)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p, n: rules.spec(n, p.shape, sizes, what=f"parameter {path_name(path)}"),
        params, names)


def _pipeline_stack(model: ModelFns, stacked: Any) -> Any:
    """Of the layer stacks (`stacked`, a tree of bools), those in the
    pipeline's cut (`PipelineFns.split`'s second part); the others stay
    with the outer parameters."""
    outer, inner = model.pipeline.split(stacked)
    return model.pipeline.merge(jax.tree.map(lambda _: False, outer), inner)


def init_state(state_plan: StatePlan, model: ModelFns, tx: optax.GradientTransformation,
               key: jax.Array, scale_cfg: loss_scale_lib.LossScaleConfig,
               param_dtype=jnp.float32, base: Any = None) -> TrainState:
    """A fresh train state, each array created directly in its sharding;
    under LoRA, around `base` (the frozen base as it is stored:
    `StatePlan.cast_base`) where given, else an initialised one."""

    def init(key):
        state = _fresh(state_plan, tx, init_params(model, key, param_dtype), scale_cfg)
        return state if base is None else state._replace(frozen=None)  # XLA drops its init

    if base is None:
        return jax.jit(init, out_shardings=state_plan.shardings)(key)
    state = jax.jit(init, out_shardings=state_plan.shardings._replace(frozen=None))(key)
    return state._replace(frozen=base)


def state_from_params(state_plan: StatePlan, tx: optax.GradientTransformation, params: Any,
                      scale_cfg: loss_scale_lib.LossScaleConfig) -> TrainState:
    """A fresh train state (step 0, new optimizer) around given master weights
    (in layer order: the saved form's)."""
    return jax.jit(lambda p: _fresh(state_plan, tx, p, scale_cfg),
                   in_shardings=(jax.tree.map(lambda t: t.sharding, state_plan.targets.params),),
                   out_shardings=state_plan.shardings)(params)


def _fresh(state_plan: StatePlan, tx, params, scale_cfg) -> TrainState:
    frozen = None
    if state_plan.frozen_names is not None:  # the base, cast once to the dtype it is used in
        params, frozen = lora.split(params)
        frozen = base_quant.store(state_plan.abstract.frozen, frozen)
    params = state_plan.pad_params(params)
    opt_state = tx.init(params)
    if state_plan.master:
        params = state_plan.to_working(params)
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, loss_scale_lib.init(scale_cfg),
                      frozen)
