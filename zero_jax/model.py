"""What zero_jax needs from a model: two pure functions.

The library is model agnostic. A model hands over `init`, which returns its
parameters boxed with logical axis names (Flax `nn.with_logical_partitioning`
metadata), and `apply`, which maps parameters and token ids to logits and
calls the sharding hooks it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from zero_jax.hooks import Hooks


@dataclasses.dataclass(frozen=True)
class ModelFns:
    """A model as the train step sees it."""

    init: Callable[[jax.Array], Any]  # PRNG key -> params boxed with logical names
    apply: Callable[[Any, jax.Array, Hooks], jax.Array]  # (params, tokens B x T, hooks) -> logits B x T x V
    vocab_size: int  # token ids are < vocab_size (logits may be padded beyond it)
    max_seq_len: int | None  # longest sequence the model takes (None: any)
    flops_per_token: Callable[[int], float]  # seq_len -> training FLOPs per token
    # seq_len -> one block as flops.Op's (what remat recomputes, for hardware FLOPs)
    block_ops: Callable[[int], Any] | None = None
    decay_mask: Callable[[Any], Any] | None = None  # params -> tree of bools: weight decay applies
    # (rows, seq_len, dtype_bytes, remat, tensor, sequence_parallel) -> activation bytes per device
    activation_bytes: Callable[..., float] | None = None
    config: Any = None  # the model's frozen shape dataclass, recorded in checkpoints
    pipeline: Any = None  # zero_jax.pipeline.records.PipelineFns, if the model can be pipelined
    layers: int = 0  # length of the stacked layer dimension (what a pipeline splits)
    # top-level parameters `apply` gathers once per call and keeps until their
    # last use (Hooks.gathered), rather than once forward and once backward
    gathered_once: tuple[str, ...] = ()
    head_cost: Callable[[int], float] | None = None  # seq_len -> the head's forward, in layers' forwards
    # logical axes the model can run unsplit where the mesh does not divide
    # them, with their sizes: {"kv_heads": 2} replicates 2 key/value heads
    # within a tensor group of 4 rather than refusing the layout
    replicable: dict[str, int] = dataclasses.field(default_factory=dict)
    # A mixture of experts: `apply` returns (logits, router statistics), and
    # this maps them and the rows' weights (B,) to (the term the router
    # losses add to the loss, their metrics) (models/moe.py `penalty`)
    router_penalty: Callable[[Any, jax.Array], tuple[jax.Array, dict]] | None = None
    experts: int = 0  # routed experts per block (0: dense), split over the `expert` axis

    def logits(self, params: Any, tokens_BxT: jax.Array, hooks: Hooks, **kwargs) -> jax.Array:
        """`apply`'s logits alone (a mixture of experts' without its statistics)."""
        out = self.apply(params, tokens_BxT, hooks, **kwargs)
        return out[0] if self.router_penalty is not None else out
