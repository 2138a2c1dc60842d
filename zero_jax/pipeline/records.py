"""What a pipeline's loop needs from the model (`PipelineFns`) and from the
layout (`StageLayout`): records, below everything that runs the loop
(executor.py, the stages), so each imports them without importing the
executor, and a model names them without importing any of it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from zero_jax.pipeline.cut import Stages


@dataclasses.dataclass(frozen=True)
class PipelineFns:
    """A model cut for pipelining: embedding, any run of stacked layers, head."""

    split: Callable[[Any], tuple[Any, Any]]  # params -> (outer params, stacked layers)
    merge: Callable[[Any, Any], Any]  # (outer, stacked) -> params
    embed: Callable[[Any, jax.Array, Any], jax.Array]  # (outer, tokens B x T, hooks) -> x
    # (stacked slice, x, hooks) -> (x, per-layer statistics: the layers'
    # scan outputs, None for a dense model)
    stage: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]
    head: Callable[[Any, jax.Array, Any], jax.Array]  # (outer, x, hooks) -> logits
    # embed only reads table rows through hooks.lookup, and head's logits run
    # over the rows of a table: both can run on row blocks (hooks.RowSplit)
    vocab_parallel: bool = False
    # A mixture of experts: (a stage's statistics over its n layers, its
    # rows' weights (B,)) -> (its part of the router losses' term in the
    # training loss, their metrics): n / L of the model's mean over layers
    penalty: Callable[[Any, jax.Array], tuple[jax.Array, dict]] | None = None


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where a pipeline's parameters and gradient accumulators live."""

    stack: Any  # specs of the stacked parameters (first dimension over `pipe`)
    stage_grads: Any  # a stage's gradient accumulator: its chunks first, `pipe` left out
    outer_grads: Any  # the embedding and head gradient accumulator
    grad_dtype: Any  # gradients are accumulated in this dtype
    gather: tuple[Any, Any] | None = None  # (outer, stacked) compute specs: gather once per step
    shard_axes: tuple[str, ...] = ()  # data-parallel axes whose gradient sums stay per device
    shards: int = 1  # product of their sizes
    stages: Stages | None = None  # the stack's cut into chunks and slots
    outer: Any = None  # storage specs of the parameters outside the stack (their `pipe` split)
    names: Any = None  # logical axes of the parameters outside the stack
    row_blocks: bool = True  # use tables in the row blocks they are stored in (row_tables)
