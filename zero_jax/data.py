"""Token data: the default corpus, token files, and deterministic batches.

The default corpus is real text every machine has: the Python standard
library's own source files, read at run time as bytes (vocabulary 256), with
about 5% of the files held out for validation. The general path is a flat
file of uint16 token ids (a memmap), with its last 5% held out.

A batch is a pure function of (seed, split, step): row i starts at offset
`offsets[i]` drawn from a generator seeded by those three numbers. Each
process builds only the rows its devices hold, and the global array is
assembled with `jax.make_array_from_process_local_data`, so a run resumes at
any step, with any number of processes, on exactly the same data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
import zlib
from pathlib import Path

import jax
import numpy as np

STDLIB = "stdlib"
_TRAIN, _VAL = 0, 1


@dataclasses.dataclass(frozen=True)
class TokenData:
    """A corpus split into train and validation token streams."""

    name: str  # where it came from, for the plan
    train: np.ndarray  # 1-D token ids
    val: np.ndarray  # 1-D token ids, disjoint from train
    vocab_size: int  # ids are < vocab_size

    def split(self, name: str) -> np.ndarray:
        return {"train": self.train, "val": self.val}[name]


def stdlib_corpus(val_every: int = 20) -> TokenData:
    """The standard library's .py files (no `test` packages, no site-packages).

    A file goes to validation when the CRC32 of its relative path is divisible
    by `val_every`: stable across machines and Python patch releases.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(directory) / name
            rel = path.relative_to(root).as_posix().encode()
            (val if zlib.crc32(rel) % val_every == 0 else train).append(path.read_bytes())
    if not train or not val:
        raise RuntimeError(f"no Python sources found under {root}")
    as_tokens = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)
    return TokenData(f"stdlib ({root})", as_tokens(train), as_tokens(val), 256)


def token_file(path: str | Path, val_fraction: float = 0.05) -> TokenData:
    """A flat uint16 token file; vocabulary from `<path>.json` or the data.

    The sidecar `{"vocab_size": N}` is read when present; otherwise the
    largest id is found by scanning the file in chunks (memory stays flat).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--data {path}: no such token file (expected flat uint16 ids)")
    if path.stat().st_size % 2:
        raise ValueError(f"--data {path}: {path.stat().st_size} bytes is not a whole number "
                         "of uint16 tokens")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    sidecar = path.with_name(path.name + ".json")
    if sidecar.exists():
        vocab = int(json.loads(sidecar.read_text())["vocab_size"])
    else:
        chunk = 1 << 24
        vocab = 1 + max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))
    cut = int(len(tokens) * (1 - val_fraction))
    return TokenData(str(path), tokens[:cut], tokens[cut:], vocab)


def load(source: str) -> TokenData:
    return stdlib_corpus() if source == STDLIB else token_file(source)


def batch_rows(tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, split: str,
               step: int, rows: range) -> np.ndarray:
    """Rows `rows` of the global (global_batch, seq_len + 1) batch of `step`."""
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"{split} split has {len(tokens)} tokens, too few for seq_len={seq_len}")
    rng = np.random.default_rng((seed, {"train": _TRAIN, "val": _VAL}[split], step))
    offsets = rng.integers(0, len(tokens) - seq_len - 1, size=global_batch)
    return np.stack([np.asarray(tokens[o:o + seq_len + 1], dtype=np.int32)
                     for o in offsets[rows.start:rows.stop]])


def local_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> range:
    """The contiguous block of batch rows held by this process's devices."""
    spans = [idx[0].indices(global_shape[0])[:2]
             for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    return range(min(s for s, _ in spans), max(e for _, e in spans))


def global_batch(data: TokenData, split: str, seq_len: int, batch_size: int, seed: int,
                 step: int, sharding: jax.sharding.Sharding) -> jax.Array:
    """The (batch_size, seq_len + 1) int32 batch of `step`, laid out by `sharding`."""
    shape = (batch_size, seq_len + 1)
    rows = local_rows(sharding, shape)
    local = batch_rows(data.split(split), seq_len, batch_size, seed, split, step, rows)
    return jax.make_array_from_process_local_data(sharding, local, shape)
