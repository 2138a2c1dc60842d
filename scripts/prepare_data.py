"""Tokenize a corpus into the shards scripts/train.py reads with --data.

    python scripts/prepare_data.py --input 'corpus/*.txt' --tokenizer bytes --out data/
    python scripts/prepare_data.py --input web.jsonl --tokenizer llama-dir/ --out data/
    python scripts/prepare_data.py --format chat --input sft.jsonl --tokenizer llama-dir/ --out sft/
    python scripts/prepare_data.py --format flat --input 'corpus/*.txt' --out tokens.bin
    python scripts/train.py --data data/ ...

Inputs (--input, repeatable, globs allowed) are read as a stream: with
--format text each text file is one document (read a megabyte at a time,
cut at line ends), and each line of a .jsonl file is one document (its
--text-field); --format jsonl reads every input as JSON lines. --format
chat reads JSON lines of {"prompt", "response"} or {"messages": [{"role",
"content"}, ...]}, renders them with the tokenizer directory's chat
template (or the plain one, see zero_jax/data/tokenizers.py) and writes a loss
mask: training counts the assistant's tokens only. --format flat writes one
flat uint16 file and its `.json` sidecar, the format read before prepared
directories.

--tokenizer is `bytes` (UTF-8 bytes, end of document 256) or a Hugging Face
directory (or file) with tokenizer.json. Worker processes tokenize in
parallel; every document ends with the end-of-document token. A document
goes to validation when the CRC32 of "<input path>\\0<index>" falls in the
first --val-fraction of its range: the split is stable, and by document.
The output directory holds uint16 shards (uint32 when the vocabulary needs
it) and a meta.json, written last (zero_jax/data/token_files.py).
Exit status: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import multiprocessing
import os
import resource
import sys
import time
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

import procmem
from zero_jax.data import token_files as shards
from zero_jax.data import tokenizers as tok_lib

FORMATS = ("text", "jsonl", "chat", "flat")
CHUNK_BYTES = 1 << 20  # text read, and sent to a worker, about this much at a time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", action="append", required=True,
                   help="a file or glob (quote it); repeat for more")
    p.add_argument("--tokenizer", default=tok_lib.BYTES,
                   help="'bytes', or a directory (or file) with a Hugging Face tokenizer.json")
    p.add_argument("--out", required=True,
                   help="directory to create (a file for --format flat); must not exist or be "
                        "empty")
    p.add_argument("--format", choices=FORMATS, default="text",
                   help="text: a file per document, JSON lines for .jsonl files; jsonl: every "
                        "input is JSON lines; chat: conversations with a loss mask; flat: one "
                        "uint16 file")
    p.add_argument("--text-field", default="text", help="the JSON field holding a document")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of documents held out for validation")
    p.add_argument("--shard-tokens", type=int, default=1 << 28,
                   help="start a new shard after this many tokens")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (1: tokenize in this process; bytes always are)")
    p.add_argument("--eos-token", default="",
                   help="end-of-document token, where the tokenizer's configs do not name one")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def expand(patterns: list[str]) -> list[Path]:
    files = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern, recursive=True))
        if not found:
            raise ValueError(f"--input {pattern}: no such file (a glob needs quotes)")
        files += [Path(f) for f in found if Path(f).is_file()]
    return files


# A unit of work: (source, index, kind, payload, first, last); kind "text"
# with the text, "chat" with the record's messages. A document is one item
# or, for a long text file, several consecutive ones (first ... last).
Item = tuple[str, int, str, object, bool, bool]


def documents(files: list[Path], fmt: str, text_field: str) -> Iterator[tuple[Item, int]]:
    """(item, bytes of input it consumed), in input order, read as a stream."""
    for path in files:
        source = str(path)
        lines = fmt in ("jsonl", "chat") or path.suffix in (".jsonl", ".json")
        if not lines:
            yield from _text_file(path, source)
            continue
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"--input {path}:{n}"
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not a JSON line ({e.msg})") from None
                if fmt == "chat":
                    try:
                        yield (source, n, "chat", tok_lib.messages_of(record), True, True), len(raw)
                    except tok_lib.TokenizerError as e:
                        raise ValueError(f"{where}: {e}") from None
                else:
                    text = record.get(text_field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise ValueError(f"{where}: no string field {text_field!r} "
                                         "(choose it with --text-field)")
                    yield (source, n, "text", text, True, True), len(raw)


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


_encoder: tok_lib.Encoder | None = None


def _start_worker(spec: tok_lib.Spec) -> None:
    global _encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _encoder = tok_lib.Encoder(spec)


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


def encoded(stream, spec: tok_lib.Spec, workers: int):
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
    return zlib.crc32(f"{source}\0{index}".encode()) < fraction * 2 ** 32


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


def main(argv=None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    out, flat, chat = Path(args.out), args.format == "flat", args.format == "chat"
    bar = None
    try:
        if not 0 < args.val_fraction < 1 and not flat:
            raise ValueError(f"--val-fraction {args.val_fraction}: must lie between 0 and 1")
        for flag, value in (("--shard-tokens", args.shard_tokens), ("--workers", args.workers)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be at least 1")
        check_out(out, flat)
        files = expand(args.input)
        if not files:
            raise ValueError(f"--input {' '.join(args.input)}: matched only directories")
        spec = tok_lib.resolve(args.tokenizer, args.eos_token)
        # Bytes need no tokenizing: sending them to workers only costs copies.
        workers = 1 if spec.name == tok_lib.BYTES else args.workers
        dtype = shards.dtype_for(spec.vocab_size)
        if flat and dtype != np.uint16:
            raise ValueError(f"--format flat: the flat format holds uint16 ids, but the "
                             f"tokenizer has {spec.vocab_size:,}; write a directory instead")
        stream = documents(files, args.format, args.text_field)
        total = sum(f.stat().st_size for f in files)
        bar = tqdm(total=total, unit="B", unit_scale=True, disable=args.no_progress,
                   mininterval=1.0, desc="tokenizing", leave=False)
        if flat:
            counts = _write_flat(out, encoded(stream, spec, workers), bar)
            Path(f"{out}.json").write_text(json.dumps({"vocab_size": spec.vocab_size}) + "\n")
        else:
            out.mkdir(parents=True, exist_ok=True)
            writers = {s: shards.SplitWriter(out, s, dtype, args.shard_tokens, chat)
                       for s in shards.SPLITS}
            counts = _write_splits(writers, encoded(stream, spec, workers), bar,
                                   args.val_fraction)
            write_meta(out, args, spec, dtype, chat, counts, files)
        bar.close()
    except (ValueError, OSError) as e:  # TokenizerError and shards.DataError are ValueErrors
        if bar is not None:
            bar.close()
            remove_partial(out, flat)  # written by this run only: check_out refused anything else
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    # VmHWM, not ru_maxrss: the latter keeps the peak of the parent this
    # process was started from.
    peak = {"this process": procmem.resident("VmHWM") / 2 ** 20,
            "a worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
    print(f"wrote {out}: {describe(counts)}; {total / 1e6:.1f} MB of input in {seconds:.1f} s "
          f"({total / 1e6 / seconds:.1f} MB/s, {workers} worker{'s' * (workers > 1)}); peak "
          "resident "
          + ", ".join(f"{mb:.0f} MB in {who}" for who, mb in peak.items() if mb))
    return 0


def _write_splits(writers, results, bar, val_fraction) -> dict[str, dict]:
    """Each document into its split's shards; the splits' counts."""
    split = "train"
    for items, encodings, size in results:
        for (source, index, *_), (ids, mask, first, _) in zip(items, encodings):
            if first:
                split = "val" if in_validation(source, index, val_fraction) else "train"
            writers[split].add(ids, mask, new_document=first)
        bar.update(size)
    counts = {s: w.close() for s, w in writers.items()}
    if not all(c["documents"] for c in counts.values()):
        raise ValueError(f"{counts['train']['documents']} train and {counts['val']['documents']} "
                         "validation documents: each split needs one; add documents or change "
                         "--val-fraction")
    return counts


def _write_flat(out: Path, results, bar) -> dict[str, dict]:
    tokens = docs = 0
    with open(out, "wb") as f:
        for _, encodings, size in results:
            for ids, _, first, _ in encodings:
                f.write(np.asarray(ids, "<u2").tobytes())
                tokens, docs = tokens + len(ids), docs + first
            bar.update(size)
    return {"all": {"documents": docs, "tokens": tokens, "shards": [{"file": out.name}]}}


def describe(counts: dict[str, dict]) -> str:
    return "; ".join(f"{s}: {c['documents']:,} documents, {c['tokens']:,} tokens in "
                     f"{len(c['shards'])} shard{'s' * (len(c['shards']) != 1)}"
                     for s, c in counts.items())


def write_meta(out: Path, args, spec: tok_lib.Spec, dtype, chat: bool, counts, files) -> None:
    shards.write_meta(out, {
        "vocab_size": spec.vocab_size, "dtype": np.dtype(dtype).str, "eos_id": spec.eos_id,
        "tokenizer": {"name": spec.name, "sha256": spec.sha256,
                      "chat_template": "model's" if spec.chat_template else
                      ("plain" if chat else "")},
        "loss_mask": chat, "input_format": args.format,
        "splits": {s: {"documents": c["documents"], "tokens": c["tokens"], "shards": c["shards"]}
                   for s, c in counts.items()},
        "val_fraction": args.val_fraction,
        "split_rule": "validation when crc32(input path + NUL + document index) < "
                      "val_fraction * 2**32",
        "inputs": [str(f) for f in files],
    })


if __name__ == "__main__":
    sys.exit(main())
