"""Token data: the corpora a run reads, checked before anything compiles,
and deterministic, process-local batches.

Three sources, one shape (a split is a list of `token_files.Shard`):
- "stdlib": real text every machine has, the Python standard library's own
  source files, read at run time as bytes (vocabulary 256), with about 5%
  of the files held out for validation;
- a directory written by `zero-jax prepare-data` (token_files.py): token shards
  memory-mapped, documents split between train and validation, and for
  instruction data a loss mask beside the tokens;
- a flat file of uint16 ids (with an optional `<file>.json` sidecar holding
  `{"vocab_size": N}`), its last 5% held out.

A batch is a pure function of (seed, split, step): each split is cut into
windows of seq_len + 1 tokens at a stride of seq_len within each shard, and
row r of step s reads the window sampler.py assigns to sample s * B + r.
Each process reads only the rows its own devices hold (for any mesh: they
need not be contiguous), and the global arrays are put together with
`jax.make_array_from_callback`, so a run resumes at any step, with any
number of processes, on exactly the same data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zero_jax.data import sampler
from zero_jax.data.token_files import DataError, Shard, check_ids, file_sha256, open_split, read_meta

STDLIB = "stdlib"


@dataclasses.dataclass(frozen=True)
class TokenData:
    """A corpus split into train and validation shards."""

    name: str  # where it came from, for the plan
    train: tuple[Shard, ...]
    val: tuple[Shard, ...]  # disjoint from train
    vocab_size: int  # ids are < vocab_size
    masked: bool = False  # a loss mask marks which tokens are targets
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # a prepared directory's

    def split(self, name: str) -> tuple[Shard, ...]:
        return {"train": self.train, "val": self.val}[name]

    def tokens(self, name: str) -> int:
        return sum(len(s.tokens) for s in self.split(name))

    def documents(self, name: str) -> int:
        return sum(len(s.docs) for s in self.split(name))


def _in_memory(name: str, parts: list[bytes]) -> Shard:
    tokens = np.frombuffer(b"".join(parts), dtype=np.uint8)
    docs = np.cumsum([0] + [len(p) for p in parts[:-1]], dtype=np.int64)
    return Shard(Path(name), tokens, docs, None)


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
    return TokenData(f"stdlib ({root})", (_in_memory("stdlib train", train),),
                     (_in_memory("stdlib validation", val),), 256)


def token_file(path: str | Path, val_fraction: float = 0.05) -> TokenData:
    """A flat uint16 token file; vocabulary from `<path>.json` or the data.

    The sidecar `{"vocab_size": N}` is read when present; otherwise the
    largest id is found by scanning the file in chunks (memory stays flat).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--data {path}: no such token file or prepared directory")
    if path.stat().st_size % 2:
        raise DataError(f"--data {path}: {path.stat().st_size} bytes is not a whole number "
                        "of uint16 tokens (a flat token file is uint16 ids)")
    if path.stat().st_size == 0:
        raise DataError(f"--data {path}: the token file is empty")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    sidecar = path.with_name(path.name + ".json")
    if sidecar.exists():
        vocab = int(json.loads(sidecar.read_text())["vocab_size"])
    else:
        chunk = 1 << 24
        vocab = 1 + max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))
    cut = int(len(tokens) * (1 - val_fraction))
    one_doc = np.zeros(1, np.int64)
    return TokenData(str(path), (Shard(path, tokens[:cut], one_doc, None),),
                     (Shard(path, tokens[cut:], one_doc, None, start=cut),), vocab)


def prepared(root: str | Path) -> TokenData:
    """A directory written by `zero-jax prepare-data`, every shard checked
    against its meta.json (sizes only: ids are checked by `check`)."""
    root = Path(root)
    meta = read_meta(root)
    train, val = (tuple(open_split(root, meta, s)) for s in ("train", "val"))
    return TokenData(str(root), train, val, int(meta["vocab_size"]), bool(meta.get("loss_mask")),
                     meta)


def load(source: str) -> TokenData:
    if source == STDLIB:
        return stdlib_corpus()
    return prepared(source) if Path(source).is_dir() else token_file(source)


def check(data: TokenData, vocab_size: int, seq_len: int, model_dirs: list[str] = ()) -> None:
    """What must hold before a run compiles, each a DataError naming the file:
    the data's tokenizer is the model's (where a model directory has a
    tokenizer.json), its vocabulary fits the model's, every split has a
    whole window, and every id is below `vocab_size` (read in chunks)."""
    made_with = data.meta.get("tokenizer", {})
    for d in model_dirs:
        theirs = Path(d) / "tokenizer.json"
        if (made_with.get("sha256") and theirs.exists()
                and file_sha256(theirs) != made_with["sha256"]):
            raise DataError(f"--data {data.name}: tokenized with {made_with.get('name')}, not with "
                            f"{theirs} (SHA-256 differs); prepare the data with --tokenizer {d}")
    if data.vocab_size > vocab_size:
        raise DataError(f"--data {data.name}: its tokenizer has {data.vocab_size:,} ids, the "
                        f"model's vocabulary {vocab_size:,}; prepare the data with the model's "
                        "tokenizer, or give the model a vocabulary that covers it (--vocab-size)")
    for split in ("train", "val"):
        if _window_counts(data.split(split), seq_len).sum() == 0:
            longest = max(len(s.tokens) for s in data.split(split))
            raise DataError(f"--data {data.name}: the {split} split's longest shard has "
                            f"{longest:,} tokens; a sequence needs seq_len + 1 = {seq_len + 1} in "
                            "one shard: use a shorter --seq-len or more data")
    check_ids(list(data.train + data.val), vocab_size)


def _window_counts(split: tuple[Shard, ...], seq_len: int) -> np.ndarray:
    return np.asarray([max(0, (len(s.tokens) - 1) // seq_len) for s in split], np.int64)


def _windows(data: TokenData, split: str, seq_len: int, global_batch: int, seed: int,
             step: int, rows: np.ndarray) -> list[tuple[Shard, int]]:
    """(shard, first token) of each of `rows`' windows in the batch of `step`."""
    shards = data.split(split)
    counts = _window_counts(shards, seq_len)
    ends = np.cumsum(counts)
    if ends[-1] == 0:
        raise DataError(f"--data {data.name}: the {split} split has no window of "
                        f"seq_len + 1 = {seq_len + 1} tokens")
    window = sampler.windows(int(ends[-1]), seed, split, step, global_batch,
                             np.asarray(rows, np.int64))
    which = np.searchsorted(ends, window, side="right")
    return [(shards[s], int((w - (ends[s] - counts[s])) * seq_len)) for s, w in zip(which, window)]


def batch_rows(data: TokenData, split: str, seq_len: int, global_batch: int, seed: int,
               step: int, rows: np.ndarray, segments: bool = True) -> dict[str, np.ndarray]:
    """Rows `rows` of the global (global_batch, seq_len + 1) batch of `step`:
    int32 "tokens", uint8 "loss_mask" (1 where a token is a target), and
    with `segments` int32 "segment_ids" (each token's document, numbered
    from 0 in its row)."""
    shape = (len(rows), seq_len + 1)
    out = {"tokens": np.empty(shape, np.int32), "loss_mask": np.ones(shape, np.uint8),
           **({"segment_ids": np.empty(shape, np.int32)} if segments else {})}
    for i, (shard, start) in enumerate(_windows(data, split, seq_len, global_batch, seed, step,
                                                rows)):
        out["tokens"][i] = shard.tokens[start:start + seq_len + 1]
        if shard.mask is not None:
            out["loss_mask"][i] = shard.mask[start:start + seq_len + 1]
        if segments:
            doc = np.searchsorted(shard.docs, np.arange(start, start + seq_len + 1), side="right")
            out["segment_ids"][i] = doc - doc[0]
    return out


def targets(data: TokenData, split: str, seq_len: int, global_batch: int, seed: int,
            step: int) -> int:
    """The number of targets (tokens the loss counts) in the whole batch of
    `step`: every row's seq_len unmasked, else the loss mask's count over the
    targets of every row (one byte per token, read on every process)."""
    if not data.masked:
        return global_batch * seq_len
    return sum(int(np.count_nonzero(shard.mask[start + 1:start + seq_len + 1]))
               for shard, start in _windows(data, split, seq_len, global_batch, seed, step,
                                            np.arange(global_batch)))


def device_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> np.ndarray:
    """The batch rows held by this process's devices, in order; with data
    axes laid out inside and across processes they need not be contiguous."""
    spans = {idx[0].indices(global_shape[0])[:2]
             for idx in sharding.addressable_devices_indices_map(global_shape).values()}
    return np.unique(np.concatenate([np.arange(a, b) for a, b in spans] or [np.zeros(0, int)]))


def global_batch(data: TokenData, split: str, seq_len: int, batch_size: int, seed: int,
                 step: int, sharding: jax.sharding.Sharding, segments: bool = False
                 ) -> dict[str, jax.Array]:
    """The batch of `step`, laid out by `sharding`: "tokens" (batch_size,
    seq_len + 1) int32; "weights" (batch_size, seq_len) float32, each
    target's share of the batch's loss (its loss mask over the batch's count
    of targets, so the weights sum to one); with `segments`, "segment_ids"
    (batch_rows). The count is known to every process (`targets`), so the
    step needs no collective to normalise the loss."""
    shape = (batch_size, seq_len + 1)
    rows = device_rows(sharding, shape)
    local = batch_rows(data, split, seq_len, batch_size, seed, step, rows, segments)
    count = targets(data, split, seq_len, batch_size, seed, step)
    local["weights"] = local["loss_mask"][:, 1:].astype(np.float32) / np.float32(max(count, 1))

    def assemble(array):
        def block(idx):
            start, stop = idx[0].indices(batch_size)[:2]
            return array[np.searchsorted(rows, np.arange(start, stop))][:, idx[1]]
        return jax.make_array_from_callback((batch_size, *array.shape[1:]), sharding, block)

    keys = ("tokens", "weights") + (("segment_ids",) if segments else ())
    return {k: assemble(local[k]) for k in keys}
