"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen model, as data.

A targeted projection y = x W (any einsum of the model's, W of logical
axes `names`) gains y += (alpha / rank) (x A) B: A spans W's input
dimensions and the rank, B the rank and W's output dimensions, so both
take W's logical axes and are laid out by the same rules (a head-split
W gives a head-split B under tensor parallelism). A starts as LoRA's
(Kaiming-uniform, bound 1 / sqrt(fan in), as peft), B at zero, so the
adapted model starts as the base.

Adapters are a module beside their weight (`w_q` -> `w_q_lora`, holding
`a` and `b`). `split` cuts a parameter tree into the adapters, which the
optimizer trains, and the frozen rest; the step differentiates the
adapters only, with the base closed over, so no gradient of the base is
computed or reduced (XLA drops what nothing reads), and the base has no
optimizer state and no master copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax.model import balance, fp8

# A target's name in --lora-targets -> the projection parameter it adapts.
TARGETS = {"q": "w_q", "k": "w_k", "v": "w_v", "o": "w_o", "gate": "w_gate", "up": "w_up",
           "down": "w_down"}
SUFFIX = "_lora"  # an adapter's module beside its weight: w_q -> w_q_lora
DROPOUT = "dropout"  # the random stream of the adapters' dropout (flax rngs)


@dataclasses.dataclass(frozen=True)
class Lora:
    """Which projections carry adapters, and their rank and scale."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # keys of TARGETS
    dropout: float = 0.0  # of the adapters' input, in training (peft's lora_dropout)
    seed: int = 0  # the dropout masks' stream (with the step and the microbatch's tokens)
    quantize_base: str = "none"  # the frozen base's block projections: none | int8 | nf4
    base_block: int = 64  # nf4: elements per block of a scale

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, weight: str) -> bool:
        return weight in {TARGETS[t] for t in self.targets}


def of(config, seed: int = 0) -> Lora | None:
    """The adapters a run's [lora] section asks for (None: rank 0, none)."""
    if not config.rank:  # dropout, quantize_base and base_block: checked as the config is built
        return None
    return Lora(config.rank, config.alpha, parse_targets(config.targets), dropout=config.dropout,
                seed=seed, quantize_base=config.quantize_base, base_block=config.base_block)


def parse_targets(text: str) -> tuple[str, ...]:
    """--lora-targets "q,v" -> ("q", "v"), each checked against TARGETS."""
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"--lora-targets {text!r}: {', '.join(unknown) or 'none given'}; choose "
                         f"from {','.join(TARGETS)} (the block's projections by name)")
    return targets


def factors(eq: str, shape: tuple[int, ...], names, rank: int) -> tuple[tuple, tuple]:
    """The two products that replace W in einsum(`eq`, x, W) at `rank`:
    ((eq, shape, names) of x -> x A, and of (x A) -> (x A) B)."""
    operands, out = eq.split("->")
    xs, ws = operands.split(",")
    r = next(c for c in "rzyxwvuts" if c not in eq)
    ins = [i for i, c in enumerate(ws) if c in xs]
    outs = [i for i, c in enumerate(ws) if c not in xs]
    kept = "".join(c for c in xs if c not in ws)
    if any(c not in out for c in kept):
        raise ValueError(f"LoRA on the product {eq}: x's dimensions {kept} do not all reach "
                         "its output")
    a_sub = "".join(ws[i] for i in ins) + r
    b_sub = r + "".join(ws[i] for i in outs)
    first = (f"{xs},{a_sub}->{kept}{r}", tuple(shape[i] for i in ins) + (rank,),
             tuple(names[i] for i in ins) + (None,))
    second = (f"{kept}{r},{b_sub}->{out}", (rank,) + tuple(shape[i] for i in outs),
              (None,) + tuple(names[i] for i in outs))
    return first, second


def adapted(module: nn.Module, hooks, eq: str, x, name: str, shape, names, y):
    """y (the product einsum(eq, x, W) of weight `name`) plus its adapter's
    term where `hooks.lora` targets it; y itself elsewhere."""
    spec = hooks.lora
    if spec is None or not spec.adapts(name):
        return y
    return y + Adapter(hooks, eq, tuple(shape), tuple(names), name=name + SUFFIX)(x).astype(y.dtype)


class Adapter(nn.Module):
    """The adapter of one weight: (alpha / rank) (x A) B. A module of its
    own (`w_q` -> `w_q_lora`, holding `a` and `b`) so that its random
    numbers come from its own stream: the base initialises as it would
    without adapters."""

    hooks: Any
    eq: str
    shape: tuple
    names: tuple

    @nn.compact
    def __call__(self, x):
        spec = self.hooks.lora
        (eq_a, shape_a, names_a), (eq_b, shape_b, names_b) = factors(self.eq, self.shape,
                                                                     self.names, spec.rank)
        bound = 1.0 / math.sqrt(math.prod(shape_a[:-1]))  # Kaiming-uniform over the fan in
        a = self.param("a", nn.with_logical_partitioning(
            lambda key, s, d: jax.random.uniform(key, s, d, -bound, bound), names_a),
            shape_a, jnp.float32)
        b = self.param("b", nn.with_logical_partitioning(nn.initializers.zeros, names_b),
                       shape_b, jnp.float32)
        if spec.dropout and self.has_rng(DROPOUT):  # training: `bound` gives the stream
            keep = jax.random.bernoulli(self.make_rng(DROPOUT), 1 - spec.dropout, x.shape)
            x = jnp.where(keep, x / (1 - spec.dropout), jnp.zeros((), x.dtype)).astype(x.dtype)
        low = self.hooks.dense(eq_a, x, a, names_a)
        return self.hooks.dense(eq_b, low, b, names_b) * spec.scale


def is_adapter(path: tuple) -> bool:
    """Whether a parameter path (jax key path) lies in an adapter (not a
    statistic `split` keeps beside the adapters)."""
    return any(str(getattr(k, "key", getattr(k, "name", k))).endswith(SUFFIX) for k in path)


def has_adapters(tree: Any) -> bool:
    return any(is_adapter(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def _kept_with_adapters(key: str) -> bool:
    """Statistics kept as parameters, which the step moves rather than the
    optimizer (FP8 amax histories, experts' selection biases): they stay
    with the adapters, so that LoRA's step moves them as a full run's does."""
    path = (jax.tree_util.DictKey(key),)
    return fp8.is_history(path) or balance.is_bias(path)


def split(tree: Any) -> tuple[dict, dict]:
    """(adapters, frozen): a nested dict of parameters (or of anything
    shaped like them) cut at the adapters' modules, each part keeping the
    nesting of what it holds. The statistics kept as parameters go with
    the adapters."""
    adapters, frozen = {}, {}
    for k, v in tree.items():
        if k.endswith(SUFFIX) or _kept_with_adapters(k):
            adapters[k] = v
        elif isinstance(v, dict):
            inner, rest = split(v)
            if inner:
                adapters[k] = inner
            if rest:
                frozen[k] = rest
        else:
            frozen[k] = v
    return adapters, frozen


def merge(adapters: dict, frozen: dict) -> dict:
    """The parameter tree of the adapters and the frozen base together."""
    out = dict(frozen)
    for k, v in adapters.items():
        out[k] = merge(v, out.get(k, {})) if isinstance(v, dict) else v
    return out


def flops_per_token(full, trained: int):
    """Training FLOPs per token under LoRA, from the model's `full`
    (seq_len -> 6 N + attention, N its matmul parameters): the frozen
    weights' gradient products are not computed, 2 N of the 6 N (`full(0)`
    is 6 N), and the adapters' `trained` parameters cost 6 each."""
    return lambda seq_len: full(seq_len) - full(0) / 3 + 6 * trained


def bound(model, frozen: Any, step: jax.Array | None = None):
    """`model` (a ModelFns) whose `apply` takes the adapters only, the
    frozen base closed over: what the step differentiates. With `step`
    and dropout, each call draws its masks from the seed, the step and a
    checksum of the tokens it is given (each microbatch its own), so that
    the masks do not depend on the layout: they are drawn over the global
    activations (jax's threefry is partitionable)."""
    apply, spec = model.apply, model.lora

    def applied(adapters, tokens, *args, **kwargs):
        if step is not None and spec is not None and spec.dropout:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(spec.seed), step),
                                     _checksum(tokens))
            kwargs = {**kwargs, "rngs": {DROPOUT: key}}
        return apply(merge(adapters, frozen), tokens, *args, **kwargs)
    return dataclasses.replace(model, apply=applied)


def _checksum(tokens: jax.Array) -> jax.Array:
    """A uint32 of the token ids and their positions (Knuth's multiplicative hash)."""
    index = jnp.arange(tokens.size, dtype=jnp.uint32).reshape(tokens.shape)
    return jnp.sum(tokens.astype(jnp.uint32) * (index * jnp.uint32(2654435761) | 1),
                   dtype=jnp.uint32)
