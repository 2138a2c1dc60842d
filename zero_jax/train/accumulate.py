"""Gradient accumulation over microbatches, and the reduction of gradients.

Two ways to accumulate, both tested against one `value_and_grad` on the
whole batch:

- `accumulate`: each microbatch's gradient is reduced into the stage's
  gradient layout and added to an accumulator held in that layout. Under
  ZeRO-3 each device then holds only its shard of the running sum (the
  reduction is a reduce-scatter per layer, inside the backward pass): memory
  1/N of the gradients, traffic once per microbatch. DeepSpeed's ZeRO-3 and
  PyTorch FSDP accumulate this way.
- `accumulate_partials`: each device adds up its own rows' gradients, the
  partial sums of DDP's `no_sync`, and nothing is communicated inside the
  microbatch loop; `reduce_partials` then reduces them once per optimizer
  step into the gradient layout. Traffic once per step, at the cost of a
  full-size accumulator on each device.

The per-device partial sums come from `vmap` over the data-parallel shards
of each microbatch (the shards' axis laid out over the data-parallel mesh
axes), with hooks that leave gradients unreduced (`Hooks.per_shard`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zero_jax.data.microbatches import split_microbatches
from zero_jax.model import fp8
from zero_jax.sharding.specs import entries, entry_axes, spec_leaves


def accumulate(value_and_grad: Callable[[Any, Any], tuple[jax.Array, Any]],
               params: Any, batch: Any, microbatches: int,
               constrain_grads: Callable[[Any], Any],
               constrain_micro: Callable[[Any], Any]) -> tuple[jax.Array, Any]:
    """Sums of the loss (a tree of metrics) and gradient over `microbatches` equal microbatches,
    each microbatch's gradient reduced into the gradient layout. A
    microbatch's loss is its share of the batch's (grads.weighted: its
    targets' weights), so the sums are the batch's loss and gradient.

    `constrain_grads` casts a gradient tree to the gradient dtype and pins it
    to the stage's gradient sharding; `constrain_micro` pins the (m, B/m, ...)
    split to the batch sharding.
    """
    if microbatches == 1:
        loss, grads = value_and_grad(params, batch)
        return loss, constrain_grads(grads)

    def body(carry, micro):
        loss_sum, acc = carry
        loss, grads = value_and_grad(params, micro)
        acc = constrain_grads(fp8.combine(acc, constrain_grads(grads)))
        return (jax.tree.map(jnp.add, loss_sum, loss), acc), None

    zeros = constrain_grads(jax.tree.map(jnp.zeros_like, params))
    micro = constrain_micro(split_microbatches(batch, microbatches))
    first = jax.tree.map(lambda x: x[0], micro)
    loss_zeros = _zeros_like(jax.eval_shape(value_and_grad, params, first)[0])
    (loss_sum, acc), _ = jax.lax.scan(body, (loss_zeros, zeros), micro)
    return loss_sum, acc


def _zeros_like(shapes: Any) -> Any:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def accumulate_partials(value_and_grad: Callable[[Any, Any], tuple[jax.Array, Any]],
                        params: Any, batch: Any, microbatches: int,
                        axes: tuple[str, ...], shards: int,
                        constrain_partials: Callable[[Any], Any],
                        constrain_micro: Callable[[jax.Array], jax.Array]
                        ) -> tuple[jax.Array, Any]:
    """Sums of the loss and gradients over `microbatches`, per shard of the
    batch over the data-parallel mesh `axes` (`shards` of them).

    `value_and_grad(params, rows)` is the loss and gradient of one shard's
    rows of one microbatch, with hooks from `Hooks.per_shard(axes)`. It runs
    under `vmap` over the shards, whose axis is laid out over `axes`, so each
    device computes its own shard's. Returns the loss sums and gradient sums
    with a leading axis of `shards`; `constrain_partials` casts such a
    gradient tree to the gradient dtype and pins its layout. `constrain_micro`
    pins the (m, shards, rows, ...) split of the batch.
    """
    per_shard = jax.vmap(value_and_grad, in_axes=(None, 0), spmd_axis_name=axes)
    micro = jax.tree.map(lambda x: x.reshape(microbatches, shards, -1, *x.shape[2:]),
                         split_microbatches(batch, microbatches))
    micro = constrain_micro(micro)

    def body(carry, rows):
        loss_sum, acc = carry
        loss, grads = per_shard(params, rows)
        acc = constrain_partials(fp8.combine(acc, constrain_partials(grads)))
        return (jax.tree.map(jnp.add, loss_sum, loss), acc), None

    zeros = constrain_partials(jax.tree.map(lambda p: jnp.zeros((shards, *p.shape), p.dtype),
                                            params))
    first = jax.tree.map(lambda x: x[0], micro)
    loss_zeros = _zeros_like(jax.eval_shape(per_shard, params, first)[0])
    return jax.lax.scan(body, (loss_zeros, zeros), micro)[0]


def reduce_partials(partials: Any, grad_specs: Any, mesh: Mesh, axes: Sequence[str],
                    zero_axes: Sequence[str]) -> Any:
    """Partial sums with a leading axis over the data-parallel mesh `axes` ->
    their sum, in the gradient layout `grad_specs`.

    The order is spelled out: a gradient sharded over ZeRO axes among `axes`
    is first summed over those into its shard (a reduce-scatter), and only
    that shard is then summed over the rest of `axes` (an all-reduce moving
    1/N_zero of the gradient: hybrid sharding); any other gradient is summed
    over `axes` at once (an all-reduce, or a reduce-scatter into its shard).
    Each sum runs over a dimension laid out over mesh axes, pinned to its
    result's layout, so GSPMD turns it into exactly that collective. (The
    same in `shard_map` with psum_scatter and psum crashes XLA:CPU's compiler
    for bf16 gradients on a mesh with other, automatic axes.)
    """
    axes = tuple(axes)
    sizes = dict(mesh.shape)

    def pin(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def reduce_one(x, spec, history):
        # In the gradient dtype: jnp.sum would sum bf16 in float32, and so
        # reduce 4 bytes per parameter across devices instead of 2. An amax
        # history's reports combine by max (fp8.py).
        op = jax.lax.max if history else jax.lax.add

        def total(x, dims):
            return jax.lax.reduce(x, jnp.zeros((), x.dtype), op, dims)

        dims = entries(spec, x.ndim - 1)
        first = tuple(a for a in zero_axes if a in axes and any(a in entry_axes(e) for e in dims))
        rest = tuple(a for a in axes if a not in first)
        if not first or not rest:
            return pin(total(x, (0,)), spec)
        # One dimension per mesh axis of the shards' axis, in `axes` order.
        x = pin(x.reshape(*(sizes[a] for a in axes), *x.shape[1:]), PartitionSpec(*axes))
        over_first = tuple(i for i, a in enumerate(axes) if a in first)
        x = pin(total(x, over_first), PartitionSpec(*rest, *dims))
        return pin(total(x, tuple(range(len(rest)))), spec)

    specs = spec_leaves(grad_specs)
    leaves, tree = jax.tree_util.tree_flatten_with_path(partials)
    return jax.tree.unflatten(tree, [reduce_one(x, s, fp8.is_history(path))
                                     for (path, x), s in zip(leaves, specs)])
