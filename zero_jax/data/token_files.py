"""The on-disk format of a prepared corpus (`zero-jax prepare-data` writes
it, corpus.py reads it): a directory of token shards and one `meta.json`.

    DATA_DIR/meta.json              what follows, written last
    DATA_DIR/train-00000.tokens     token ids, little-endian uint16 or uint32
    DATA_DIR/train-00000.docs       int64 offset of each document's first token
    DATA_DIR/train-00000.mask       uint8 per token, 1 where it is a loss target
                                    (instruction data only)
    DATA_DIR/val-00000.tokens ...   the validation split, likewise

Documents never cross shards; each ends with the end-of-document token.
`meta.json` holds the vocabulary size, dtype, tokenizer (name and SHA-256 of
its file), end-of-document id, and per split the shards with their token
and document counts. A shard's size on disk must agree with its count: a
truncated or extra shard is refused at load (`open_split`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "zero_jax.tokens/1"
META = "meta.json"
SPLITS = ("train", "val")


class DataError(ValueError):
    """The data cannot be trained on; the message names the file and how to fix it."""


def dtype_for(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id below `vocab_size`."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file (a tokenizer.json), read a megabyte at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shard_name(split: str, index: int, kind: str) -> str:
    return f"{split}-{index:05d}.{kind}"


class SplitWriter:
    """Appends documents to a split's shards, starting a new shard once one
    holds `shard_tokens` tokens (a document is never cut)."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int, masked: bool):
        self.out, self.split, self.dtype = out, split, dtype
        self.shard_tokens, self.masked = shard_tokens, masked
        self.shards: list[dict[str, Any]] = []
        self._files: dict[str, Any] = {}
        self._docs: list[int] = []

    def add(self, tokens: np.ndarray, mask: np.ndarray | None = None,
            new_document: bool = True) -> None:
        """Append a document, or (`new_document` False) more of the last one."""
        if new_document:
            if not self.shards or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._next_shard()
            self._docs.append(self.shards[-1]["tokens"])
            self.shards[-1]["documents"] += 1
        shard = self.shards[-1]
        self._files["tokens"].write(np.asarray(tokens, self.dtype).tobytes())
        if self.masked:
            self._files["mask"].write(np.asarray(mask, np.uint8).tobytes())
        shard["tokens"] += len(tokens)

    def _next_shard(self) -> None:
        self._close_shard()
        i = len(self.shards)
        self.shards.append({"file": shard_name(self.split, i, "tokens"), "tokens": 0,
                            "documents": 0})
        kinds = ("tokens", "mask") if self.masked else ("tokens",)
        self._files = {k: open(self.out / shard_name(self.split, i, k), "wb") for k in kinds}
        self._docs = []

    def _close_shard(self) -> None:
        if self.shards:
            np.asarray(self._docs, "<i8").tofile(
                self.out / shard_name(self.split, len(self.shards) - 1, "docs"))
        for f in self._files.values():
            f.close()
        self._files = {}

    def close(self) -> dict[str, Any]:
        self._close_shard()
        return {"tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards), "shards": self.shards}


def write_meta(out: Path, meta: dict[str, Any]) -> None:
    """meta.json by rename, so a directory with one is complete."""
    tmp = out / (META + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **meta}, indent=1) + "\n")
    os.replace(tmp, out / META)


def read_meta(root: Path) -> dict[str, Any]:
    path = root / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"--data {root}: no {META}; a directory written by "
                        "zero-jax prepare-data writes one (an interrupted one does not)") from None
    except json.JSONDecodeError as e:
        raise DataError(f"--data {path}: not valid JSON ({e}); prepare the data again") from None
    if meta.get("format") != FORMAT:
        raise DataError(f"--data {path}: format {meta.get('format')!r}, this version reads "
                        f"{FORMAT!r}; prepare the data again")
    for key in ("vocab_size", "dtype", "splits"):
        if key not in meta:
            raise DataError(f"--data {path}: no {key!r} field; prepare the data again")
    return meta


@dataclasses.dataclass(frozen=True)
class Shard:
    path: Path
    tokens: np.ndarray  # 1-D ids (a memory map)
    docs: np.ndarray  # offsets of document starts
    mask: np.ndarray | None  # uint8 per token, or None: every token is a target
    start: int = 0  # offset of tokens[0] in the file, for messages


def open_split(root: Path, meta: dict[str, Any], split: str) -> list[Shard]:
    """Memory maps of a split's shards, each checked against meta.json."""
    dtype = np.dtype(meta["dtype"])
    masked = bool(meta.get("loss_mask"))
    entries = meta["splits"].get(split, {}).get("shards", [])
    if not entries:
        raise DataError(f"--data {root}: the {split} split has no shards; prepare the data with "
                        "more documents (or a larger --val-fraction for validation)")
    shards = []
    for entry in entries:
        path = root / entry["file"]
        count = int(entry["tokens"])
        if count == 0:
            raise DataError(f"--data {path}: an empty shard in {META}; prepare the data again")
        files = {"tokens": (path, dtype), "docs": (path.with_suffix(".docs"), np.dtype("<i8"))}
        if masked:
            files["mask"] = (path.with_suffix(".mask"), np.dtype("u1"))
        maps = {}
        for kind, (p, dt) in files.items():
            if not p.exists():
                raise DataError(f"--data {p}: missing, but {META} lists the shard; prepare the "
                                "data again")
            want = (count if kind != "docs" else int(entry["documents"])) * dt.itemsize
            have = p.stat().st_size
            if have != want:
                what = "truncated" if have < want else "longer than recorded"
                raise DataError(f"--data {p}: {have:,} bytes, {META} says {want:,} "
                                f"({what}); prepare the data again")
            maps[kind] = np.memmap(p, dtype=dt, mode="r") if want else np.zeros(0, dt)
        docs = maps["docs"]
        if len(docs) and (docs[0] != 0 or (np.diff(docs) <= 0).any() or docs[-1] >= count):
            raise DataError(f"--data {path.with_suffix('.docs')}: document offsets are not "
                            f"increasing from 0 within {count} tokens; prepare the data again")
        shards.append(Shard(path, maps["tokens"], docs, maps.get("mask")))
    return shards


def check_ids(shards: list[Shard], vocab_size: int, chunk: int = 1 << 24) -> None:
    """Every id below `vocab_size`, checked `chunk` tokens at a time (memory
    stays flat); raises DataError naming the first bad id's shard and offset."""
    for shard in shards:
        for start in range(0, len(shard.tokens), chunk):
            block = np.asarray(shard.tokens[start:start + chunk])
            if block.size and int(block.max()) >= vocab_size:
                at = int(np.argmax(block >= vocab_size))
                raise DataError(
                    f"--data {shard.path}: token offset {shard.start + start + at:,} is id "
                    f"{int(block[at])}, not below the model's vocabulary of {vocab_size:,}; the "
                    "data was tokenized for another vocabulary: prepare it with the model's "
                    "tokenizer, or give the model a vocabulary that covers it (--vocab-size)")
