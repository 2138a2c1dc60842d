"""The order in which training reads its windows: a pure function of
(seed, split, step, row), defined here bit for bit.

The data is cut into `n` windows (corpus.py). Sample `i = step * batch + row`
of a split is window `permute(i mod n)` of epoch `i div n`, where `permute`
is a pseudo-random bijection of [0, n) keyed by (seed, split, epoch): every
window is read once per epoch, in an order that changes every epoch.

The bijection is a 4-round Feistel network on the smallest even number of
bits that holds n, with cycle walking (an output >= n is permuted again
until it lands in range). Its round function is the SplitMix64 finaliser
(Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
2014) of the right half XOR a round key. Keys chain the same finaliser over
the words (seed, split, epoch, round). Everything is unsigned 64-bit
arithmetic modulo 2**64, so the order is the same on every machine and
every NumPy version; it depends on no generator's stream.
"""

from __future__ import annotations

import numpy as np

ORDER = "feistel4-splitmix64/1"  # recorded in checkpoints: a change of this order changes the name
_SPLITS = {"train": 0, "val": 1}
_ROUNDS = 4


def mix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser of each uint64 of `x` (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrapping is the definition
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key(*words: int) -> np.uint64:
    """One 64-bit key from integer words, each folded in by `mix64`."""
    h = np.zeros((), np.uint64)
    for w in words:
        h = mix64(h ^ np.uint64(w & 0xFFFFFFFFFFFFFFFF))
    return np.uint64(h)


def permute(i: np.ndarray, n: int, k: np.uint64) -> np.ndarray:
    """The image of each index in [0, n) under the bijection keyed by `k`."""
    if n < 1:
        raise ValueError(f"cannot permute {n} items")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    round_keys = [key(int(k), r) for r in range(_ROUNDS)]

    def feistel(x):
        left, right = x >> np.uint64(half), x & mask
        for rk in round_keys:
            left, right = right, left ^ (mix64(right ^ rk) & mask)
        return (left << np.uint64(half)) | right

    x = feistel(np.asarray(i, dtype=np.uint64))
    # Cycle walking: the network permutes [0, 4**half), under 4 n, so each
    # index leaves the range a few times at most before landing in it.
    while (out := x >= np.uint64(n)).any():
        x[out] = feistel(x[out])
    return x.astype(np.int64)


def windows(n: int, seed: int, split: str, step: int, batch: int, rows: np.ndarray) -> np.ndarray:
    """Window index (of `n`) of each of `rows` in the `batch`-row batch of `step`."""
    sample = np.int64(step) * batch + np.asarray(rows, dtype=np.int64)
    epoch, within = np.divmod(sample, n)
    out = np.empty_like(sample)
    for e in np.unique(epoch):
        here = epoch == e
        out[here] = permute(within[here], n, key(seed, _SPLITS[split], int(e)))
    return out
