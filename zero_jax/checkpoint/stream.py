"""Parameters placed into their sharded layout one tensor at a time.

An import from another framework's files (models/common/hf_files.py) must not hold the
model in host memory: `place` asks for one leaf, or one layer of a stacked
leaf, at a time, puts it into the target's sharding and lets it go before
asking for the next. A stacked leaf is created on the devices first and
each layer written into it in place (a donated update), so host memory stays
near the largest single tensor, whatever the model's size.

A tensor stays in its file's dtype on the host (a bf16 file: 2 bytes a
parameter) and is cast to the target's dtype on the devices, once placed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from zero_jax.sharding.specs import named_leaves, spec_leaves

# (our parameter path, layer index or None) -> that tensor, as numpy
Produce = Callable[[str, int | None], np.ndarray]


def place(targets: Any, names: Any, produce: Produce) -> Any:
    """A tree like `targets` (jax.ShapeDtypeStruct leaves with shardings),
    each leaf built from `produce`: whole, or layer by layer where its first
    logical name (`names`, PartitionSpecs of logical names) is `layers`."""
    paths = {path: (t, n) for (path, t), n in zip(named_leaves(targets).items(),
                                                    spec_leaves(names))}
    placed = {}
    for path, (target, logical) in paths.items():
        if len(logical) and logical[0] == "layers":
            placed[path] = _stacked(path, target, produce)
        else:
            placed[path] = _whole(target, _checked(path, produce(path, None), target.shape))
    return jax.tree.unflatten(jax.tree.structure(targets), list(placed.values()))


def _checked(path: str, x: np.ndarray, shape) -> np.ndarray:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{path}: the weights give shape {tuple(x.shape)}, the model has "
                         f"{tuple(shape)}")
    return np.asarray(x)


def _whole(target, x: np.ndarray) -> jax.Array:
    return put(x, target.dtype, target.sharding)


def put(x: np.ndarray, dtype, sharding) -> jax.Array:
    """`x` in `sharding` and `dtype`: placed in its own dtype, then cast on
    the devices, so the host never holds a cast copy (a bf16 file stays 2
    bytes a parameter on the host; the float32 copy exists only in device
    memory)."""
    on_devices = sharding.with_memory_kind("device")
    placed = jax.make_array_from_callback(x.shape, on_devices, lambda idx: x[idx])
    if placed.dtype != dtype:
        placed = placed.astype(dtype)  # an elementwise op keeps the sharding
    # In the sharding's memory kind: offloaded masters live in host memory.
    placed = placed if on_devices == sharding else jax.device_put(placed, sharding)
    return placed.block_until_ready()  # `x` and the narrow copy are let go now, not later


def _stacked(path: str, target, produce: Produce) -> jax.Array:
    stack = _zeros(target.shape, target.dtype, target.sharding)
    for i in range(target.shape[0]):
        layer = _checked(f"{path} (layer {i})", produce(path, i), target.shape[1:])
        # Waited for, so that the host holds one layer, not as many as are in flight.
        stack = _write(stack, layer, i).block_until_ready()
        del layer
    return stack


def _zeros(shape, dtype, sharding) -> jax.Array:
    return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def _write(stack: jax.Array, layer: jax.Array, i: int) -> jax.Array:
    """`stack` with `layer` at index `i` of its first dimension, in place;
    the layer arrives in its file's dtype and is cast on the devices."""
    return jax.lax.dynamic_update_index_in_dim(stack, layer.astype(stack.dtype), i, 0)
