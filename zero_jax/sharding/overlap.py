"""The layer scan's collectives overlapped with its compute, on XLA:GPU.

At ZeRO-3 the step's per-layer collectives sit inside the layer scan's
loops: each layer's weights are all-gathered where they are used
(param_use.py, `Use.gather`) from a slice of the stored stack that depends
on the loop index only, in the forward loop and again in the backward, and
each layer's weight gradient is reduced to its shard in the backward loop as
it is produced. In program order a collective waits for the compute before
it, and the compute after waits for the collective.

XLA:GPU's collective pipeliner moves them across iterations, and its
latency-hiding scheduler runs them beside the compute in between:
- the all-gather of layer i+1's weights is issued in iteration i, so it
  streams while layer i computes (the prefetch; it needs nothing from
  layer i);
- the reduction of layer i's weight gradient is finished in the next
  iteration of the backward loop, while layer i-1's backward runs.

That is the overlap a hand-written prefetch in the scan would give, without
a second copy of the schedule to keep numerically equal to the first, and
the memory cost is the one layer's buffer in flight that such a prefetch
has too. The loop stays a loop (the pipeliner peels the first gather out
ahead of it and the last reduction after it), and the math and its order
are unchanged: the same collectives on the same values. Other backends
are not asked (runtime/xla_options.py spells the options for the running
XLA); XLA:CPU's collectives are synchronous, so there is nothing for them to
overlap with, and no GPU time has been measured yet.
`--no-overlap-collectives` compiles without them.

At stages 0 to 2 the loops hold no collective: the partitioner reduces the
stacked gradients once, after the backward loop (tests/test_overlap.py reads
both from the compiled HLO), and the optimizer waits for that reduction
whatever the schedule, so there is nothing to pipeline.
"""

from __future__ import annotations

from zero_jax.runtime import xla_options
from zero_jax.sharding import zero

# The per-layer collectives of a ZeRO-3 scan, by what XLA is asked to do with each.
ZERO3_WANTS = (
    xla_options.PIPELINE_ALL_GATHER,  # the weights' gather, an iteration early
    xla_options.PIPELINE_REDUCE_SCATTER,  # the gradient's reduction, an iteration late
)


def wants(zero_stage: int) -> tuple[xla_options.Want, ...]:
    """What XLA is asked for to overlap the per-layer collectives of a step
    at `zero_stage` with the layer scan's compute (module docstring)."""
    return ZERO3_WANTS if zero.stage(zero_stage).params else ()
