"""The options of a layout's steps, as one frozen record.

A step is jitted with its options bound (`functools.partial(train_step,
options=...)`, step.py), so they are fixed before tracing and the same on
every device. The record sits below both its users: the step (step.py)
and the gradient strategies it picks from (grads.py).
"""

from __future__ import annotations

import dataclasses

from zero_jax.pipeline.schedule import Schedule
from zero_jax.precision.loss_scale import LossScaleConfig


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a layout's train and eval steps compute, built once by the Job."""

    microbatches: int = 1  # the batch's gradients accumulated over this many microbatches
    loss_scale: LossScaleConfig = LossScaleConfig()  # dynamic loss scaling (fp16), skipped steps
    schedule: Schedule | None = None  # a pipeline's schedule over `pipe`; None: no pipeline
    gather_once: bool = False  # ZeRO-3 under a pipeline: a stage's weights gathered once per step
    reduce_once: bool = True  # gradients reduced once per step (else once per microbatch)
    tables_in_rows: bool = True  # a pipeline's loops use tables in the row blocks they are stored in
    overlap: bool = True  # XLA:GPU overlaps per-layer collectives with the layer scan (overlap.py)
