"""What zero_jax needs from a model: the contract a model implements.

The library is model agnostic. A model hands over a `ModelFns`: at its core
`init`, which returns its parameters boxed with logical axis names (Flax
`nn.with_logical_partitioning` metadata), and `apply`, which maps parameters
and token ids to logits and calls the sharding hooks it is given. The other
fields describe it to the rest of the library: its FLOPs and one block as
`Op`s (what remat recomputes), its activation bytes, its weight-decay mask,
and, if it can be pipelined, its cut into embedding, layers and head
(`PipelineFns`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from zero_jax.model.hooks import Hooks
from zero_jax.model.lora import Lora


@dataclasses.dataclass(frozen=True)
class Op:
    """One tensor a block computes, per token.

    `name`: its checkpoint name (what remat policies select), None if
    unnamed. `flops`: forward FLOPs per token to compute it from its
    `inputs`. `needs`: the tensors its own backward reads (default: its
    inputs; a residual add needs none; a softmax its own output, "self").
    "x" is the block's input, always kept.

    `width` and `split` give its shape, for the planner's kernel times:
    elements per token of the tensor, and how tensor parallelism divides
    its work: "out" its outputs (a column-parallel product, attention's
    heads, what they feed), "in" a product's inputs (row-parallel: the
    output projection), "" none (the residual stream, whole on every
    device, or split over tokens under sequence parallelism).
    """

    key: str
    name: str | None
    flops: float
    inputs: tuple[str, ...]
    dot: bool = False  # a matrix product (what dots_saveable keeps)
    needs: tuple[str, ...] | None = None
    width: int = 0  # elements per token
    split: str = ""  # "out" | "in" | "": what tensor parallelism divides

    def backward_reads(self) -> tuple[str, ...]:
        needs = self.inputs if self.needs is None else self.needs
        return tuple(self.key if n == "self" else n for n in needs)


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
class ModelFns:
    """A model as the train step sees it."""

    # (PRNG key, hooks=None) -> params boxed with logical names; `hooks` says
    # what the parameters depend on (delayed FP8 scaling adds amax histories)
    init: Callable[..., Any]
    apply: Callable[[Any, jax.Array, Hooks], jax.Array]  # (params, tokens B x T, hooks) -> logits B x T x V
    vocab_size: int  # token ids are < vocab_size (logits may be padded beyond it)
    max_seq_len: int | None  # longest sequence the model takes (None: any)
    flops_per_token: Callable[[int], float]  # seq_len -> training FLOPs per token
    # seq_len -> one block as Op's (what remat recomputes, for hardware FLOPs)
    block_ops: Callable[[int], Any] | None = None
    decay_mask: Callable[[Any], Any] | None = None  # params -> tree of bools: weight decay applies
    # (rows, seq_len, dtype_bytes, remat, tensor, sequence_parallel) -> activation bytes per device
    activation_bytes: Callable[..., float] | None = None
    config: Any = None  # the model's frozen shape dataclass, recorded in checkpoints
    pipeline: PipelineFns | None = None  # its cut for pipelining, if it can be pipelined
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
    # losses add to the loss, their metrics) (models/llama/moe.py `penalty`)
    router_penalty: Callable[[Any, jax.Array], tuple[jax.Array, dict]] | None = None
    experts: int = 0  # routed experts per block (0: dense), split over the `expert` axis
    lora: Lora | None = None  # its low-rank adapters (init's hooks ask for them), if any
    # Aux-loss-free balancing: the step by which each step moves the
    # experts' selection biases against their load error (balance.py; 0: fixed)
    balance_rate: float = 0.0
    # Multi-token prediction modules: `apply` takes `mtp_rows` (context/order.py
    # `ahead`) and returns their loss among the statistics, which
    # `router_penalty` weighs into the training loss
    mtp_depth: int = 0

    def logits(self, params: Any, tokens_BxT: jax.Array, hooks: Hooks, **kwargs) -> jax.Array:
        """`apply`'s logits alone (a mixture of experts' without its statistics)."""
        out = self.apply(params, tokens_BxT, hooks, **kwargs)
        return out[0] if self.router_penalty is not None else out
