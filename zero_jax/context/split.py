"""How a run splits its sequences over `context`: the strategy `auto`
picks, and what is checked before anything compiles (one line each,
naming the sizes and the fix)."""

from __future__ import annotations

from zero_jax import config as config_lib
from zero_jax.context.order import Context


def choose(strategy: str, heads: int, tensor: int, context: int, pipelined: bool,
           attention: str) -> str:
    """`auto`: Ulysses where the heads each device holds split over
    `context` (its all-to-alls move a block of q, k, v and the output once
    each, whatever c) and the model's attention keeps no T x T scores
    (cuDNN's kernel); else ring, whose blocks live one at a time: Ulysses
    under XLA's attention holds a whole sequence's scores for its heads, as
    much as a device without a context axis. Inside pipeline stages,
    all-gather instead of ring (`RING_IN_PIPELINE`)."""
    if strategy != "auto":
        return strategy
    if (heads // tensor) % context == 0 and attention == "cudnn":
        return "ulysses"
    return "all-gather" if pipelined else "ring"


# Why ring attention does not run inside pipeline stages: a stage runs its
# forward under a condition of its own (pipeline/train_stage.py), and
# XLA:CPU's collective-permute waits for every device its pairs name, those
# of the other stages too, which are elsewhere: the step deadlocks.
RING_IN_PIPELINE = ("a stage runs its forward on its own, and the ring's collective-permutes "
                    "would wait for every stage's devices")


def of_run(run: config_lib.RunConfig, heads: int, sizes: dict[str, int], attention: str,
           pipelined: bool) -> Context | None:
    """How attention crosses a `context` axis (zero_jax/context), checked
    against the sequence and the model's `heads` (0: unknown); None without one."""
    c = sizes.get("context", 1)
    if c == 1:
        return None
    T, t = run.data.seq_len, sizes["tensor"]
    if T % (2 * c):
        raise config_lib.ConfigError(
            f"--seq-len {T} with context={c}: the balanced layout cuts each sequence into 2 x "
            f"context = {2 * c} chunks; use a --seq-len that {2 * c} divides (e.g. "
            f"{max(2 * c, T // (2 * c) * 2 * c)})")
    if run.parallel.grad_reduce == "step":
        raise config_lib.ConfigError(
            f"--grad-reduce step with context={c}: attention across context runs per device "
            "over every axis that splits the batch, which per-device partial sums would split; "
            "use --grad-reduce microbatch (or auto)")
    strategy = choose(run.parallel.context_attention, heads, t, c, pipelined, attention)
    if strategy == "ring" and pipelined:
        raise config_lib.ConfigError(
            f"--context-attention ring with pipe={sizes['pipe']}: "
            f"{RING_IN_PIPELINE}; use all-gather or ulysses (auto picks one)")
    if strategy == "ulysses" and (heads % t or (heads // t) % c):
        raise config_lib.ConfigError(
            f"--context-attention ulysses with {heads} heads on tensor={t}, context={c}: each "
            f"device's {heads // t if heads % t == 0 else heads / t:g} heads must split over "
            f"context={c}; use ring or all-gather, or a context axis that divides {heads // t}")
    if attention == "cudnn" and strategy != "ulysses" and run.model.attention == "cudnn":
        raise config_lib.ConfigError(
            f"--attention cudnn with --context-attention {strategy}: {strategy} computes its own "
            "blocks of attention (scores in float32); use --attention xla (or auto), or ulysses, "
            "which runs the model's attention on whole sequences")
    return Context(strategy, c)
