"""Activation checkpointing policies, selected by name.

The policy decides which activations of a transformer block are kept for the
backward pass; the rest are recomputed. Models apply it to their scanned
block (`nn.remat`), and name activations with `checkpoint_name` through
`Hooks.act(..., name=...)`.

A model names every activation its backward pass needs and nothing else:
what a fused implementation keeps. Unnamed intermediates (LayerNorm
statistics, GELU's polynomial) are recomputed, as fused kernels do. No policy
keeps the parameters as they were gathered for use (`Hooks.weight` names them
WEIGHT): under ZeRO-3 that would hold every layer's full weights on every
device until the backward pass; they are gathered again instead.

    none            keep every named activation; recompute only elementwise work
    full            keep only each block's input; recompute the block
    dots_saveable   keep matrix-product outputs; recompute the elementwise rest
    save_names      keep only the named activations listed in `names`
    offload         move the named activations listed in `names` to host memory
"""

from __future__ import annotations

import dataclasses
import typing

import jax

from zero_jax.config.sections import PolicyName

POLICIES: tuple[str, ...] = typing.get_args(PolicyName)
WEIGHT = "weight"  # the name Hooks.weight gives a parameter at its point of use
DOT = "dot"  # the name Hooks.dense gives a matrix product's output


@dataclasses.dataclass(frozen=True)
class Remat:
    policy: PolicyName = "none"
    names: tuple[str, ...] = ()  # activation names for save_names / offload

    def __post_init__(self):
        if self.policy in ("save_names", "offload") and not self.names:
            raise ValueError(f"--remat {self.policy} needs activation names (--save-names)")
        if {WEIGHT, DOT} & set(self.names):
            raise ValueError(f"{WEIGHT!r} and {DOT!r} are reserved names, not activations")

    def keeps(self, op) -> bool:
        """Whether the backward pass finds `op` (a flops.Op of a block) kept
        rather than recomputing it: the FLOPs side of `jax_policy`."""
        if self.policy == "none":
            return op.name is not None
        if self.policy == "full":
            return False
        if self.policy == "dots_saveable":
            return op.dot
        return op.name in self.names

    def jax_policy(self):
        """The `jax.checkpoint` policy for the scanned block."""
        p = jax.checkpoint_policies
        if self.policy == "none":
            return p.save_any_names_but_these(WEIGHT, DOT)
        if self.policy == "full":
            return p.nothing_saveable
        if self.policy == "dots_saveable":
            # Hooks.dense is one custom primitive, not a dot_general: it is named.
            return p.save_from_both_policies(p.dots_saveable, p.save_only_these_names(DOT))
        if self.policy == "save_names":
            return p.save_only_these_names(*self.names)
        return p.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(self.names),
            offload_src="device", offload_dst="pinned_host")

    def describe(self) -> str:
        return self.policy + (f" ({', '.join(self.names)})"
                              if self.policy in ("save_names", "offload") else "")


def parse_names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())
