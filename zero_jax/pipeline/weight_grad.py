"""A chunk's backward split in two, for zero-bubble schedules: B, the input
gradient, when the previous stage waits for it; W, the weights' gradients,
later, without running the forward again.

Every matrix product of the layers goes through `Hooks.dense`. For B, each
stacked matrix of the chunk is given as a `param_use.Tapped`, with zero
taps shaped as its product's input and output in every layer, and B's vjp
is taken with respect to the chunk's input, the taps and the parameters
that are not matrices (norms, biases: B gives their gradients), not the
matrices. The taps' cotangents are each product's input and output
gradient, and no matrix gradient is computed. W makes those: one product
per matrix and layer, reduced as the whole backward would reduce them
(`Hooks.dense_weight_grad`).

What waits between B and W is those inputs and output gradients, for every
product of every layer of the chunk (`kept_per_token`): for a GPT block 16
d_model values per token and layer, for Llama-3-8B's 20, where a stash
entry holds d_model per chunk.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zero_jax.model.param_use import Tapped


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix's product, per layer: einsum `eq` of x and the weight."""

    eq: str
    names: tuple
    x: jax.ShapeDtypeStruct
    y: jax.ShapeDtypeStruct
    w: jax.ShapeDtypeStruct  # one layer's weight

    def act_names(self) -> tuple[tuple, tuple]:
        """Logical names of x's and the output's dimensions, as the product
        laid them out: a weight's dimension by the weight's name, the first
        two others the batch and the sequence."""
        inputs, out = self.eq.replace(" ", "").split("->")
        xs, ws = inputs.split(",")

        def of(letters):
            return tuple(self.names[ws.index(ch)] if ch in ws else
                         (("batch", "seq")[i] if i < 2 else None)
                         for i, ch in enumerate(letters))
        return of(xs), of(out)


class _Seen:
    """What `Hooks.dense` records of a tapped weight without taps: its products."""

    def __init__(self):
        self.uses: set[tuple] = set()

    def record(self, eq, names, x, y) -> None:
        self.uses.add((eq, names, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       jax.ShapeDtypeStruct(y.shape, y.dtype)))


class SplitBackward:
    """B and W for chunks shaped as `chunk`, run by `run(chunk, x, hooks)`,
    on inputs shaped as `x` (one shard's rows)."""

    def __init__(self, run: Callable, chunk: Any, x: jax.ShapeDtypeStruct, hooks):
        leaves, self.treedef = jax.tree.flatten(chunk)
        seen = [_Seen() for _ in leaves]
        probe = self.treedef.unflatten([Tapped(leaf, seen=s) for leaf, s in zip(leaves, seen)])
        # Shapes only: the products are the same without the mesh.
        jax.eval_shape(lambda c, x: run(c, x, dataclasses.replace(hooks, mesh=None)), probe, x)
        self.products: list[Product | None] = []
        for leaf, s in zip(leaves, seen):
            if len(s.uses) > 1:
                raise ValueError(f"a weight of shape {leaf.shape[1:]} is used in {len(s.uses)} "
                                 "matrix products of a layer; a split backward keeps one per weight")
            self.products.append(
                Product(*next(iter(s.uses)), w=jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype))
                if s.uses else None)
        self.slots = leaves[0].shape[0]

    def taps(self, lead: tuple[int, ...] = ()) -> list[tuple[jax.Array, jax.Array]]:
        """Zero taps, (slots, *product shape) each, behind `lead` dimensions."""
        def zeros(a):
            return jnp.zeros((*lead, self.slots, *a.shape), a.dtype)
        return [(zeros(p.x), zeros(p.y)) for p in self.products if p is not None]

    def tap_specs(self, rules, sizes: dict, lead: tuple) -> list[tuple[PartitionSpec, PartitionSpec]]:
        """Where the taps live behind `lead` (specs of the W buffer's slot and
        shard dimensions) and the layer dimension: as their products had
        them, so that W multiplies them where they are."""
        out = []
        for p in (p for p in self.products if p is not None):
            xn, yn = p.act_names()
            out.append(tuple(PartitionSpec(*lead, None, *rules.spec(n, a.shape, sizes, what="tap"))
                             for n, a in ((xn, p.x), (yn, p.y))))
        return out

    def input_grad(self, run: Callable, chunk: Any, x: jax.Array, dy: jax.Array):
        """B: (the taps' cotangents, gradients of the parameters that are not
        matrices, dx) for output gradient dy of `run(chunk, x)`."""
        leaves = self.treedef.flatten_up_to(chunk)
        others = [leaf for leaf, p in zip(leaves, self.products) if p is None]

        def f(x, taps, others):
            taps, others = iter(taps), iter(others)
            tree = [next(others) if p is None else Tapped(leaf, *next(taps))
                    for leaf, p in zip(leaves, self.products)]
            return run(self.treedef.unflatten(tree), x)

        _, vjp = jax.vjp(f, x, self.taps(), others)
        dx, taps, g_others = vjp(dy)
        return taps, g_others, dx

    def weight_grads(self, hooks, taps) -> list[jax.Array]:
        """W: each matrix's gradient, (slots, ...), from B's taps."""
        out = []
        for (x, g), p in zip(taps, (p for p in self.products if p is not None)):
            def one(x, g, p=p):
                return hooks.dense_weight_grad(p.eq, x, g, p.w, p.names)
            out.append(jax.vmap(one)(x, g))
        return out

    def of_others(self, g_others: list) -> Any:
        """A chunk-shaped tree of B's gradients: the non-matrix parameters',
        None at the matrices."""
        others = iter(g_others)
        return self.treedef.unflatten([next(others) if p is None else None
                                       for p in self.products])

    def of_matrices(self, g_mats: list) -> Any:
        """A chunk-shaped tree of W's gradients: the matrices', None elsewhere."""
        mats = iter(g_mats)
        return self.treedef.unflatten([None if p is None else next(mats)
                                       for p in self.products])


def kept_per_token(stage: Callable, layer: Any, d_model: int, dtype, hooks) -> int:
    """Values a waiting W holds per token and layer: every matrix
    product's input and output gradient, from the products of one layer
    (`layer`: a stack of one, as `stage(layer, x, hooks)` runs it) on one
    token. Shapes only; nothing is computed."""
    x = jax.ShapeDtypeStruct((1, 1, d_model), dtype)
    split = SplitBackward(stage, layer, x, hooks)
    return sum(math.prod(p.x.shape) + math.prod(p.y.shape) for p in split.products if p)
