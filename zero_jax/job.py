"""A run config plus a model -> everything a run needs, built abstractly.

`prepare` resolves the mesh against the devices, validates the config,
builds the optimizer and the layout of the whole train state: all before
anything is compiled or allocated, so every error surfaces here.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from zero_jax import config as config_lib
from zero_jax import mesh as mesh_lib
from zero_jax import optim, rules, state, step
from zero_jax.model import ModelFns


@dataclasses.dataclass(frozen=True)
class Job:
    run: config_lib.RunConfig
    model: ModelFns
    layout: state.Layout
    tx: optax.GradientTransformation
    lr: optax.Schedule

    @property
    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        t = self.run.train
        return jax.ShapeDtypeStruct((t.batch_size, self.run.data.seq_len + 1), jnp.int32,
                                    sharding=self.layout.batch_sharding)

    def compile_train_step(self):
        """The jitted train step, compiled ahead of time for the abstract state."""
        fn = step.jit_train_step(self.layout, self.model, self.tx, self.lr,
                                 self.run.train.microbatches)
        return fn.lower(self.layout.abstract, self.abstract_batch).compile()

    def compile_eval_step(self):
        fn = step.jit_eval_step(self.layout, self.model)
        return fn.lower(self.layout.abstract.params, self.abstract_batch).compile()

    def init_state(self) -> state.TrainState:
        return state.init_state(self.layout, self.model, self.tx,
                                jax.random.key(self.run.train.seed))


def mesh_config(run: config_lib.RunConfig) -> mesh_lib.MeshConfig:
    cfg = mesh_lib.load(run.parallel.mesh)
    if run.parallel.zero_shard_axes:
        axes = tuple(a.strip() for a in run.parallel.zero_shard_axes.split(",") if a.strip())
        cfg = dataclasses.replace(cfg, zero_shard_axes=axes)
    return cfg


def prepare(run: config_lib.RunConfig, model: ModelFns,
            devices: Sequence[jax.Device] | None = None) -> Job:
    mesh, shape = mesh_lib.build_mesh(mesh_config(run), devices)
    config_lib.validate(run, shape)
    lr = optim.schedule(run.optim, run.train.steps)
    tx = optim.optimizer(run.optim, lr, model.decay_mask)
    layout = state.make_layout(model, tx, mesh, shape, rules.preset(run.parallel.rules),
                               run.parallel.zero_stage, run.parallel.min_shard_elements)
    return Job(run, model, layout, tx, lr)
