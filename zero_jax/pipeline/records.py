"""What a pipeline's loop needs to know of where its state lives (`StagePlan`): a record,
below everything that runs the loop (executor.py, the stages), so each
imports it without importing the executor. What it needs from the model,
`PipelineFns`, is part of the model's contract (model/contract.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from zero_jax.pipeline.cut import Stages


@dataclasses.dataclass(frozen=True)
class StagePlan:
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
