"""Checksums of arrays that do not depend on how the arrays are sharded.

Orbax does not checksum array data: a flipped bit restores silently with a
wrong value. A checkpoint therefore carries, for every array, two 32-bit sums
of its bit patterns weighted by position, computed on the devices where the
array lives. Integer sums modulo 2^32 are exact whatever the reduction order,
so the same array gives the same checksum under any mesh, ZeRO stage or
process count: a checkpoint saved under one layout is verified after it is
restored under another. A change of one bit changes the first sum (the
weights are odd), and the second uses different weights on a mixed word.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.runtime.distributed import local
from zero_jax.sharding.specs import named_leaves
from zero_jax.sharding.offload import HOST

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
# The second sum's constants: an element's index is mixed into its word by
# the golden-ratio constant and weighted by Knuth's multiplicative hash.
_MIX = 0x9E3779B9
_WEIGHT = 2654435761


def _words(x: jax.Array) -> jax.Array:
    """The bit pattern of every element, as uint32."""
    if x.dtype in (jnp.bool_, jnp.uint4):  # one bit; four (LoRA's nf4 codes): their value
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size not in _UINT:
        raise TypeError(f"no checksum for {x.dtype} arrays")
    return jax.lax.bitcast_convert_type(x, _UINT[size]).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    w = _words(x)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride)
        stride *= x.shape[d]
    first = jnp.sum(w * (2 * index + 1), dtype=jnp.uint32)
    mixed = w ^ (w >> 16) ^ (index * jnp.uint32(_MIX))
    second = jnp.sum(mixed * ((index * jnp.uint32(_WEIGHT)) | 1), dtype=jnp.uint32)
    return jnp.stack([first, second])


@functools.partial(jax.jit, static_argnums=1)
def _checksums(tree: Any, dtype=None) -> Any:
    return jax.tree.map(lambda x: _checksum(x if dtype is None else x.astype(dtype)), tree)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _one_from_host(x: jax.Array, device: jax.sharding.Sharding, dtype=None) -> jax.Array:
    """The sums of `x`, held in host memory, brought to `device` inside the
    program: jaxlib 0.12's CPU client cannot `device_put` a program's host
    output back to the device ("Unsupported layout ... S(5)"); a transfer
    that the program makes, as the offloaded step's own fetches are, runs."""
    x = jax.device_put(x, device)
    return _checksum(x if dtype is None else x.astype(dtype))


def checksums(tree: Any, dtype=None) -> dict[str, list[int]]:
    """{leaf path: [sum1, sum2]} for every array leaf of `tree` (cast to
    `dtype` first, inside the program, where given).

    The sums come back replicated; every process reads its own copy. Leaves
    in host memory (offload.py) are brought to the device one at a time and
    summed there, so the device never holds more than one of them.
    """
    flat = flatten(tree)
    on_host = {p for p, x in flat.items()
               if getattr(getattr(x, "sharding", None), "memory_kind", None) == HOST}
    sums = flatten(local(_checksums({p: x for p, x in flat.items() if p not in on_host}, dtype)))
    for p in on_host:
        x = flat[p]
        sums[p] = local(_one_from_host(x, x.sharding.with_memory_kind("device"), dtype))
    return {path: [int(v) for v in sums[path]] for path in flat}


def flatten(tree: Any) -> dict[str, Any]:
    """{dotted leaf path: leaf}, the names used in checkpoint manifests."""
    return named_leaves(tree)


class RunningChecksum:
    """The same two sums as `checksums`, fed on the host piece by piece.

    `add(piece, offset)` takes consecutive elements starting at flat index
    `offset` (a layer of a stacked array, say) and works in bounded chunks, so
    an export can verify arrays it never holds whole.
    """

    _CHUNK = 1 << 16  # elements: the uint64 temporaries stay near 0.5 MiB each

    def __init__(self):
        self.first = 0
        self.second = 0

    def add(self, piece: np.ndarray, offset: int) -> None:
        flat = np.ascontiguousarray(piece).reshape(-1)
        if flat.dtype == np.bool_:
            words_all = flat.view(np.uint8)
        else:
            words_all = flat.view(np.dtype(_UINT[flat.dtype.itemsize]))
        mask = np.uint64(0xFFFFFFFF)
        for start in range(0, flat.size, self._CHUNK):
            w = words_all[start:start + self._CHUNK].astype(np.uint64)
            idx = (np.arange(start, start + w.size, dtype=np.uint64) + np.uint64(offset)) & mask
            self.first = (self.first + int(np.sum(w * ((2 * idx + 1) & mask)))) & 0xFFFFFFFF
            mixed = (w ^ (w >> np.uint64(16)) ^ ((idx * np.uint64(_MIX)) & mask)) & mask
            weight = ((idx * np.uint64(_WEIGHT)) & mask) | np.uint64(1)
            self.second = (self.second + int(np.sum((mixed * weight) & mask))) & 0xFFFFFFFF

    @property
    def value(self) -> list[int]:
        return [self.first, self.second]
