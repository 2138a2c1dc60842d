"""A corpus tokenized into the shards `zero-jax train --data` reads.

Inputs are read as a stream: with format "text" each text file is one
document (read a megabyte at a time, cut at line ends), and each line of a
.jsonl file is one document (its text field); "jsonl" reads every input as
JSON lines (but tables, below); "chat" reads JSON lines of {"prompt", "response"} or
{"messages": [...]}, rendered with the tokenizer's chat template
(tokenizers.py) with a loss mask on the assistant's tokens; "flat" writes
one flat uint16 file and its `.json` sidecar, the format read before
prepared directories. Whatever the format, a Parquet or Arrow file (and a
`datasets` save_to_disk directory, its Arrow files) is read by record
batches (arrow.py), each row a record as a JSON line's would be: the text
field's column, or the chat fields' columns.

Worker processes tokenize in parallel, at most two tasks of about a
megabyte each per worker in flight, so memory stays bounded; every document
ends with the end-of-document token. A document goes to validation when the
CRC32 of "<input file name>\\0<index>" falls in the first `val_fraction` of
its range (the index of a line or a table's row counts from 1), and so does
the corpus's first document (a small corpus then
still has one): the split is by document, and stable when the corpus is
moved or read through another path (the file's name, not its directory, is
hashed). The output directory holds
uint16 shards (uint32 when the vocabulary needs it) and a meta.json,
written last (token_files.py). Errors are ValueErrors naming the flag of
`zero-jax prepare-data` at fault.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import multiprocessing
import os
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from zero_jax.data import arrow, token_files
from zero_jax.data import tokenizers as tokenizers_lib

FORMATS = ("text", "jsonl", "chat", "flat")
CHUNK_BYTES = 1 << 20  # text read, and sent to a worker, about this much at a time

# A unit of work: (source, index, kind, payload, first, last); kind "text"
# with the text, "chat" with the record's messages. A document is one item
# or, for a long text file, several consecutive ones (first ... last).
Item = tuple[str, int, str, object, bool, bool]


@dataclasses.dataclass(frozen=True)
class Request:
    """What to prepare; each field is the `zero-jax prepare-data` flag of its name."""

    out: Path
    fmt: str = "text"  # one of FORMATS
    text_field: str = "text"
    val_fraction: float = 0.05
    shard_tokens: int = 1 << 28
    workers: int = 1
    files: tuple[Path, ...] = ()  # the inputs, expanded (expand), after check

    @property
    def flat(self) -> bool:
        return self.fmt == "flat"


def expand(patterns: list[str]) -> tuple[Path, ...]:
    """The files the --input patterns name: globs expanded, a save_to_disk or
    Arrow directory replaced by its Arrow files, other directories a glob
    matches skipped (one named outright is refused)."""
    files: dict[Path, None] = {}  # in order, each once (a recursive glob may repeat one)
    for pattern in patterns:
        found = sorted(glob.glob(pattern, recursive=True))
        if not found:
            raise ValueError(f"--input {pattern}: " + ("the glob matches no file"
                             if glob.has_magic(pattern) else "no such file (a glob needs quotes)"))
        for path in map(Path, found):
            if path.is_file():
                files[path] = None
            elif (tables := arrow.dataset_files(path)) is not None:
                files.update(dict.fromkeys(tables))
            elif not glob.has_magic(pattern):
                raise ValueError(f"--input {pattern}: a directory, but not a datasets "
                                 "save_to_disk directory (state.json) or one of *.arrow files; "
                                 "give files or a glob")
    if not files:
        raise ValueError(f"--input {' '.join(patterns)}: matched only directories")
    return tuple(files)


def _json_line(raw: bytes, where: str, fmt: str, text_field: str) -> tuple[str, object]:
    """(kind, payload) of one JSON line of the input."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON line ({e.msg})") from None
    return _record(record, where, fmt, text_field)


def _record(record, where: str, fmt: str, text_field: str) -> tuple[str, object]:
    """(kind, payload) of one record, a JSON line's or a table row's."""
    if fmt == "chat":
        try:
            return "chat", tokenizers_lib.messages_of(record)
        except tokenizers_lib.TokenizerError as e:
            raise ValueError(f"{where}: {e}") from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError(f"{where}: no string field {text_field!r} (choose it with --text-field)")
    return "text", text


def table_columns(path: Path, fmt: str, text_field: str) -> list[str]:
    """The columns of a Parquet or Arrow input that its records need: the
    chat fields it has, or the text field, which must be a string column."""
    have = arrow.columns(path)
    listing = ", ".join(f"{name} ({kind})" for name, kind in have.items())
    if fmt == "chat":
        names = [c for c in tokenizers_lib.CHAT_FIELDS if c in have]
        if "messages" not in names and not {"prompt", "response"} <= set(names):
            raise ValueError(f"--input {path}: chat data needs a column 'messages', or 'prompt' "
                             f"and 'response'; its columns: {listing}")
        return names
    if text_field not in have:
        raise ValueError(f"--text-field {text_field}: {path} has no such column; its columns: "
                         f"{listing}")
    if have[text_field] not in arrow.STRING_TYPES:
        raise ValueError(f"--text-field {text_field}: the column of {path} holds "
                         f"{have[text_field]}, not strings; its columns: {listing}")
    return [text_field]


def documents(files, fmt: str, text_field: str) -> Iterator[tuple[Item, int]]:
    """(item, bytes of input it consumed), in input order, read as a stream."""
    for path in files:
        source = str(path)
        if arrow.is_table(path):
            yield from _table_rows(path, fmt, text_field)
        elif not (fmt in ("jsonl", "chat") or path.suffix in (".jsonl", ".json")):
            yield from _text_file(path, source)
        else:
            with open(path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    if raw.strip():
                        kind, payload = _json_line(raw, f"--input {path}:{n}", fmt, text_field)
                        yield (source, n, kind, payload, True, True), len(raw)


def _table_rows(path: Path, fmt: str, text_field: str) -> Iterator[tuple[Item, int]]:
    """A table's rows as documents, numbered from 1 like JSON lines. A null
    is read as an absent field: Arrow has one column for every row."""
    names = table_columns(path, fmt, text_field)
    for n, (row, size) in enumerate(arrow.records(path, names, CHUNK_BYTES), 1):
        record = {k: v for k, v in row.items() if v is not None}
        kind, payload = _record(record, f"--input {path}: row {n}", fmt, text_field)
        yield (str(path), n, kind, payload, True, True), size


def _text_file(path: Path, source: str) -> Iterator[tuple[Item, int]]:
    with open(path, "rb") as f:
        piece, first = f.read(CHUNK_BYTES), True
        while piece:
            nxt = f.read(CHUNK_BYTES)
            if nxt:  # cut at the last line end, the rest goes with the next read
                cut = piece.rfind(b"\n") + 1 or len(piece)
                piece, nxt = piece[:cut], piece[cut:] + nxt
            text = piece.decode("utf-8", errors="replace")
            yield (source, 0, "text", text, first, not nxt), len(piece)
            piece, first = nxt, False


# Each worker process's tokenizer, made once by _start_worker: a pool's
# initializer can only leave state in module globals.
_encoder: tokenizers_lib.Encoder | None = None


def _start_worker(spec: tokenizers_lib.Spec) -> None:
    global _encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _encoder = tokenizers_lib.Encoder(spec)


def encode(items: list[Item]) -> list[tuple[np.ndarray, np.ndarray | None, bool, bool]]:
    """(ids, mask or None, first, last) of each item, in the worker's encoder."""
    out = []
    for _, _, kind, payload, first, last in items:
        if kind == "chat":
            ids, mask = _encoder.chat(payload)
            out.append((ids, mask, first, last))
        else:
            out.append((_encoder.text(payload, first, last), None, first, last))
    return out


def tasks(stream: Iterator[tuple[Item, int]]) -> Iterator[tuple[list[Item], int]]:
    """Items grouped into tasks of about CHUNK_BYTES of input."""
    group, size = [], 0
    for item, n in stream:
        group.append(item)
        size += n
        if size >= CHUNK_BYTES:
            yield group, size
            group, size = [], 0
    if group:
        yield group, size


def encoded(stream, spec: tokenizers_lib.Spec, workers: int):
    """(task's items, their encodings, input bytes) in order; at most two
    tasks per worker in flight, so memory stays bounded."""
    if workers <= 1:
        _start_worker(spec)
        for items, size in tasks(stream):
            yield items, encode(items), size
        return
    ctx = multiprocessing.get_context("spawn")  # workers import no JAX, and fork no threads
    with ctx.Pool(workers, initializer=_start_worker, initargs=(spec,)) as pool:
        pending = collections.deque()
        for items, size in tasks(stream):
            pending.append((items, pool.apply_async(encode, (items,)), size))
            if len(pending) >= 2 * workers:
                items, result, size = pending.popleft()
                yield items, result.get(), size
        while pending:
            items, result, size = pending.popleft()
            yield items, result.get(), size


def in_validation(source: str, index: int, fraction: float) -> bool:
    name = Path(source).name
    return zlib.crc32(f"{name}\0{index}".encode()) < fraction * 2 ** 32


def check(request: Request) -> None:
    """The request's numbers and its output, before any input is looked at."""
    if not 0 < request.val_fraction < 1 and not request.flat:
        raise ValueError(f"--val-fraction {request.val_fraction}: must lie between 0 and 1")
    for flag, value in (("--shard-tokens", request.shard_tokens), ("--workers", request.workers)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    check_out(request.out, request.flat)


def check_inputs(request: Request) -> None:
    """The columns of every Parquet and Arrow input, from their schemas alone,
    before anything is written."""
    for path in request.files:
        if arrow.is_table(path):
            table_columns(path, request.fmt, request.text_field)


def check_out(out: Path, flat: bool) -> None:
    if flat:
        if out.exists():
            raise ValueError(f"--out {out}: exists; prepared data is never overwritten, "
                             "choose another name or remove it")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory; prepared data is "
                         "never overwritten, choose another or remove it")


def remove_partial(out: Path, flat: bool) -> None:
    """What an interrupted run wrote: no meta.json, so unusable, and in the
    way of the next run."""
    for path in [Path(f"{out}.json"), out] if flat else sorted(out.glob("*")) + [out]:
        if path.is_file():
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def dtype_for(request: Request, spec: tokenizers_lib.Spec) -> np.dtype:
    """The shards' id dtype for the tokenizer's vocabulary, where the format holds it."""
    dtype = token_files.dtype_for(spec.vocab_size)
    if request.flat and dtype != np.uint16:
        raise ValueError(f"--format flat: the flat format holds uint16 ids, but the "
                         f"tokenizer has {spec.vocab_size:,}; write a directory instead")
    return dtype


def workers_for(request: Request, spec: tokenizers_lib.Spec) -> int:
    """Bytes need no tokenizing: sending them to workers only costs copies."""
    return 1 if spec.name == tokenizers_lib.BYTES else request.workers


def prepare(request: Request, spec: tokenizers_lib.Spec, on_bytes: Callable[[int], object] = int) -> dict[str, dict]:
    """Tokenize `request.files` with `spec` into `request.out`; the counts of each
    split ("all" for the flat format). `on_bytes(n)` hears of each n bytes
    of input done (a progress bar)."""
    dtype = dtype_for(request, spec)
    results = encoded(documents(request.files, request.fmt, request.text_field), spec, workers_for(request, spec))
    if request.flat:
        counts = _write_flat(request.out, results, on_bytes)
        Path(f"{request.out}.json").write_text(json.dumps({"vocab_size": spec.vocab_size}) + "\n")
        return counts
    chat = request.fmt == "chat"
    request.out.mkdir(parents=True, exist_ok=True)
    writers = {s: token_files.SplitWriter(request.out, s, dtype, request.shard_tokens, chat)
               for s in token_files.SPLITS}
    counts = _write_splits(writers, results, on_bytes, request.val_fraction)
    write_meta(request, spec, dtype, counts)
    return counts


def _write_splits(writers, results, on_bytes, val_fraction) -> dict[str, dict]:
    """Each document into its split's shards; the splits' counts."""
    split, documents = "train", 0
    for items, encodings, size in results:
        for (source, index, *_), (ids, mask, first, _) in zip(items, encodings):
            if first:
                # The corpus's first document always validates, so that a
                # small corpus has a validation split.
                val = documents == 0 or in_validation(source, index, val_fraction)
                split, documents = ("val" if val else "train"), documents + 1
            writers[split].add(ids, mask, new_document=first)
        on_bytes(size)
    counts = {s: w.close() for s, w in writers.items()}
    if not all(c["documents"] for c in counts.values()):
        raise ValueError(f"{counts['train']['documents']} train and {counts['val']['documents']} "
                         "validation documents: each split needs one; add documents or change "
                         "--val-fraction")
    return counts


def _write_flat(out: Path, results, on_bytes) -> dict[str, dict]:
    tokens = docs = 0
    with open(out, "wb") as f:
        for _, encodings, size in results:
            for ids, _, first, _ in encodings:
                f.write(np.asarray(ids, "<u2").tobytes())
                tokens, docs = tokens + len(ids), docs + first
            on_bytes(size)
    return {"all": {"documents": docs, "tokens": tokens, "shards": [{"file": out.name}]}}


def write_meta(request: Request, spec: tokenizers_lib.Spec, dtype, counts: dict[str, dict]) -> None:
    chat = request.fmt == "chat"
    token_files.write_meta(request.out, {
        "vocab_size": spec.vocab_size, "dtype": np.dtype(dtype).str, "eos_id": spec.eos_id,
        "tokenizer": {"name": spec.name, "sha256": spec.sha256,
                      "chat_template": "model's" if spec.chat_template else
                      ("plain" if chat else "")},
        "loss_mask": chat, "input_format": request.fmt,
        "splits": {s: {"documents": c["documents"], "tokens": c["tokens"], "shards": c["shards"]}
                   for s, c in counts.items()},
        "val_fraction": request.val_fraction,
        "split_rule": "validation when crc32(input file name + NUL + document index) < "
                      "val_fraction * 2**32, and the first document",
        "inputs": [str(f) for f in request.files],
    })
