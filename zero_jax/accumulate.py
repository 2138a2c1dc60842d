"""Gradient accumulation over microbatches, in the stage's gradient layout.

The accumulator is the scan carry, constrained to the gradient sharding, so
under ZeRO-2/3 each device holds only its shard of the running sum. Tested
against one `value_and_grad` on the whole batch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def split_microbatches(batch: jax.Array, microbatches: int) -> jax.Array:
    """(B, ...) -> (m, B/m, ...), microbatch j holding rows j, j + m, j + 2m, ...

    Strided rows keep each microbatch spread evenly over every data shard:
    a device holding a contiguous block of B/N rows holds B/(N m) rows of each
    microbatch, so the split moves no data between devices.
    """
    B = batch.shape[0]
    return batch.reshape(B // microbatches, microbatches, *batch.shape[1:]).swapaxes(0, 1)


def accumulate(value_and_grad: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
               params: Any, batch: jax.Array, microbatches: int,
               constrain_grads: Callable[[Any], Any],
               constrain_micro: Callable[[jax.Array], jax.Array]) -> tuple[jax.Array, Any]:
    """Mean loss and mean gradient over `microbatches` equal microbatches.

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
        acc = constrain_grads(jax.tree.map(jnp.add, acc, constrain_grads(grads)))
        return (loss_sum + loss, acc), None

    zeros = constrain_grads(jax.tree.map(jnp.zeros_like, params))
    micro = constrain_micro(split_microbatches(batch, microbatches))
    (loss_sum, acc), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
    return loss_sum / microbatches, jax.tree.map(lambda g: g / microbatches, acc)
