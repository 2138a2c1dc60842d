"""The train state, built abstract first: shapes -> shardings -> sharded init.

Nothing is materialised before its sharding is known: `make_layout` works on
`jax.eval_shape` results only, so the memory report, the plan and checkpoint
restore can use it for models that would not fit on this machine, and
`init_state` creates every array directly in its final layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zero_jax import loss_scale as loss_scale_lib
from zero_jax import precision as precision_lib
from zero_jax import zero as zero_lib
from zero_jax.mesh import DATA_AXES, MeshShape
from zero_jax.model import ModelFns
from zero_jax.rules import AxisRules


class TrainState(NamedTuple):
    step: Any  # int32 scalar: steps taken (batches consumed, skipped steps included)
    params: Any  # parameter tree, in the policy's parameter dtype
    opt_state: Any  # optax state
    loss_scale: Any  # loss_scale.LossScale: scale and skip counters (replicated scalars)


def logical_names(boxed_params: Any) -> Any:
    """Tree of PartitionSpecs of logical names (None for unannotated dims)."""

    def names(leaf):
        if isinstance(leaf, meta.AxisMetadata) and hasattr(leaf, "names"):
            return PartitionSpec(*leaf.names)
        return PartitionSpec(*(None,) * len(leaf.shape))

    return jax.tree.map(names, boxed_params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


@dataclasses.dataclass(frozen=True)
class Layout:
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

    @property
    def abstract_grads(self) -> Any:
        return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, self.grad_dtype),
                            self.abstract.params)

    @property
    def state_specs(self) -> TrainState:
        scalars = jax.tree.map(lambda _: PartitionSpec(), self.abstract.loss_scale)
        return TrainState(PartitionSpec(), self.specs.params, self.specs.opt_state, scalars)

    def named(self, specs: Any) -> Any:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    @property
    def shardings(self) -> TrainState:
        return self.named(self.state_specs)

    @property
    def targets(self) -> TrainState:
        """The abstract state with its shardings: what a restore fills in."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract, self.shardings)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Token batches (B, T): rows split over every data-parallel axis."""
        axes = tuple(a for a in DATA_AXES if self.mesh_shape.sizes[a] > 1)
        return NamedSharding(self.mesh, PartitionSpec(axes or None))

    @property
    def data_parallel_size(self) -> int:
        sizes = self.mesh_shape.sizes
        return sizes["data"] * sizes["fsdp"]


def init_params(model: ModelFns, key: jax.Array, param_dtype) -> Any:
    return precision_lib.cast_tree(nn.unbox(model.init(key)), param_dtype)


def make_layout(model: ModelFns, tx: optax.GradientTransformation, mesh: Mesh,
                mesh_shape: MeshShape, rules: AxisRules, zero_stage: int,
                min_shard_elements: int, param_dtype=jnp.float32,
                grad_dtype=jnp.float32) -> Layout:
    """Abstract state and the specs of every leaf; raises ShardingError early."""
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0)))  # traces the key too: no compile
    names = logical_names(boxed)
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0), param_dtype))
    opt_state = jax.eval_shape(tx.init, params)
    scale = jax.eval_shape(lambda: loss_scale_lib.init(loss_scale_lib.LossScaleConfig()))
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, scale)
    sizes = mesh_shape.sizes
    compute = jax.tree_util.tree_map_with_path(
        lambda path, p, n: rules.spec(
            n, p.shape, sizes,
            what=f"parameter {jax.tree_util.keystr(path, simple=True, separator='.')}"),
        params, names)
    placement = zero_lib.Placement.on(mesh_shape, min_shard_elements)
    specs = zero_lib.state_specs(params, compute, names, opt_state, tx,
                                 zero_lib.stage(zero_stage), placement)
    return Layout(mesh, mesh_shape, rules, zero_stage, abstract, names, specs, placement,
                  jnp.dtype(grad_dtype))


def init_state(layout: Layout, model: ModelFns, tx: optax.GradientTransformation,
               key: jax.Array, scale_cfg: loss_scale_lib.LossScaleConfig,
               param_dtype=jnp.float32) -> TrainState:
    """A fresh train state, each array created directly in its sharding."""

    def init(key):
        params = init_params(model, key, param_dtype)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                          loss_scale_lib.init(scale_cfg))

    return jax.jit(init, out_shardings=layout.shardings)(key)


def state_from_params(layout: Layout, tx: optax.GradientTransformation, params: Any,
                      scale_cfg: loss_scale_lib.LossScaleConfig) -> TrainState:
    """A fresh train state (step 0, new optimizer) around given parameters."""

    def init(params):
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                          loss_scale_lib.init(scale_cfg))

    return jax.jit(init, in_shardings=(layout.shardings.params,),
                   out_shardings=layout.shardings)(params)
