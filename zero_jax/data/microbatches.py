"""A batch split into microbatches, in the order that moves no data: the
gradient accumulation (train/accumulate.py) and the pipeline's loop
(pipeline/executor.py) both read it."""

from __future__ import annotations

from typing import Any

import jax


def split_microbatches(batch: Any, microbatches: int) -> Any:
    """(B, ...) -> (m, B/m, ...) for each array of `batch`, microbatch j
    holding rows j, j + m, j + 2m, ...

    Strided rows keep each microbatch spread evenly over every data shard:
    a device holding a contiguous block of B/N rows holds B/(N m) rows of each
    microbatch, so the split moves no data between devices.
    """
    return jax.tree.map(
        lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1),
        batch)
