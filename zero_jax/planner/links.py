"""How long one collective takes: a latency plus its bytes over the link.

NCCL moves a collective over a ring or, for an all-reduce, a double binary
tree, and picks the faster (NCCL's own tuning model, src/graph/tuning.cc,
is where the latencies in meshes/devices/*.toml come from):

  ring  every device sends (n - 1) / n of the payload per pass, one pass
        for an all-gather, a reduce-scatter or an all-to-all, two for an
        all-reduce, in n - 1 steps per pass, each step paying the link's
        latency;
  tree  an all-reduce reduces up and broadcasts down a tree of depth
        log2 n: each device moves the payload twice, in 2 log2 n steps.

Each collective also pays a fixed latency. The bandwidth and latency are the
slowest link's the group crosses (inside a node, or across nodes).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Link:
    """The slowest link a group of devices crosses."""

    bandwidth: float  # bytes/s per device, one direction
    latency: float  # seconds per step
    base: float  # seconds per collective


def ring_factor(op: str, n: int) -> float:
    """Bytes a device sends per payload byte of collective `op` over a ring
    of `n` devices; ops not named move as an all-gather does."""
    if op == "all-reduce":
        return 2 * (n - 1) / n
    if op == "collective-permute":
        return 1.0
    return (n - 1) / n  # all-gather, reduce-scatter, all-to-all


def collective_s(op: str, payload: float, n: int, link: Link) -> float:
    """Seconds of one collective `op` of `payload` bytes over `n` devices."""
    if n <= 1:
        return 0.0
    steps = 1 if op == "collective-permute" else (2 if op == "all-reduce" else 1) * (n - 1)
    ring = link.base + steps * link.latency + ring_factor(op, n) * payload / link.bandwidth
    if op != "all-reduce":
        return ring
    depth = math.ceil(math.log2(n))
    tree = link.base + 2 * depth * link.latency + 2 * payload / link.bandwidth
    return min(ring, tree)
