"""Tokenize a corpus into the shards `zero-jax train` reads with --data.

    zero-jax prepare-data --input 'corpus/*.txt' --tokenizer bytes --out data/
    zero-jax prepare-data --input web.jsonl --tokenizer llama-dir/ --out data/
    zero-jax prepare-data --input 'fineweb/*.parquet' --tokenizer llama-dir/ --out data/
    zero-jax prepare-data --input saved-dataset/ --tokenizer llama-dir/ --out data/
    zero-jax prepare-data --format chat --input sft.jsonl --tokenizer llama-dir/ --out sft/
    zero-jax prepare-data --format flat --input 'corpus/*.txt' --out tokens.bin
    zero-jax train --data data/ ...

Inputs (--input, repeatable, globs allowed) are read as a stream: with
--format text each text file is one document (read a megabyte at a time, cut
at line ends), and each line of a .jsonl file is one document (its
--text-field); --format jsonl reads every other input as JSON lines. Parquet
(.parquet) and Arrow (.arrow) files, and directories written by `datasets`
save_to_disk, are read a record batch at a time, each row one record: its
--text-field column, or with --format chat its chat columns (pyarrow, the
data extra). --format chat reads records of {"prompt", "response"} or
{"messages": [{"role", "content"}, ...]}, renders them with the tokenizer
directory's chat template (or the plain one, see
zero_jax/data/tokenizers.py) and writes a loss mask: training counts the
assistant's tokens only. --format flat writes one flat uint16 file and its
`.json` sidecar, the format read before prepared directories.

--tokenizer is `bytes` (UTF-8 bytes, end of document 256) or a Hugging Face
directory (or file) with tokenizer.json. Worker processes tokenize in
parallel; every document ends with the end-of-document token. A document
goes to validation when the CRC32 of "<input file name>\\0<index>" falls in the
first --val-fraction of its range, and so does the first document: the
split is stable, and by document.
The output directory holds uint16 shards (uint32 when the vocabulary needs
it) and a meta.json, written last (zero_jax/data/prepare.py, token_files.py).
Exit status: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time
from pathlib import Path

from tqdm import tqdm

from zero_jax.data import prepare
from zero_jax.data import tokenizers as tokenizers_lib
from zero_jax.runtime import procmem


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", action="append", required=True,
                   help="a file or glob (quote it), or a datasets save_to_disk directory; "
                        "repeat for more")
    p.add_argument("--tokenizer", default=tokenizers_lib.BYTES,
                   help="'bytes', or a directory (or file) with a Hugging Face tokenizer.json")
    p.add_argument("--out", required=True,
                   help="directory to create (a file for --format flat); must not exist or be "
                        "empty")
    p.add_argument("--format", choices=prepare.FORMATS, default="text",
                   help="text: a file per document, JSON lines for .jsonl files, a row per "
                        "document for Parquet and Arrow; jsonl: every other input is JSON lines; "
                        "chat: conversations with a loss mask; flat: one uint16 file")
    p.add_argument("--text-field", default="text",
                   help="the JSON field, or Parquet or Arrow column, holding a document")
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


def checked_request(args: argparse.Namespace) -> tuple[prepare.Request, tokenizers_lib.Spec]:
    """The request and its tokenizer, every flag checked before anything is written."""
    request = prepare.Request(out=Path(args.out), fmt=args.format, text_field=args.text_field,
                      val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
                      workers=args.workers)
    prepare.check(request)  # the numbers and --out first, then the inputs
    request = dataclasses.replace(request, files=prepare.expand(args.input))
    prepare.check_inputs(request)
    spec = tokenizers_lib.resolve(args.tokenizer, args.eos_token)
    prepare.dtype_for(request, spec)
    return request, spec


def describe(counts: dict[str, dict]) -> str:
    return "; ".join(f"{s}: {c['documents']:,} documents, {c['tokens']:,} tokens in "
                     f"{len(c['shards'])} shard{'s' * (len(c['shards']) != 1)}"
                     for s, c in counts.items())


def summary(request: prepare.Request, counts: dict, total: int, seconds: float, workers: int) -> str:
    """The closing line: what was written, how fast, and the peak memory."""
    # VmHWM, not ru_maxrss: the latter keeps the peak of the parent this
    # process was started from.
    peak = {"this process": procmem.resident("VmHWM") / 2 ** 20,
            "a worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
    return (f"wrote {request.out}: {describe(counts)}; {total / 1e6:.1f} MB of input in "
            f"{seconds:.1f} s ({total / 1e6 / seconds:.1f} MB/s, {workers} "
            f"worker{'s' * (workers > 1)}); peak resident "
            + ", ".join(f"{mb:.0f} MB in {who}" for who, mb in peak.items() if mb))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    try:
        request, spec = checked_request(args)
        total = sum(f.stat().st_size for f in request.files)
    except (ValueError, OSError) as e:  # TokenizerError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=args.no_progress,
               mininterval=1.0, desc="tokenizing", leave=False)
    try:
        with bar:
            counts = prepare.prepare(request, spec, bar.update)
    except (ValueError, OSError) as e:  # shards.DataError is a ValueError
        prepare.remove_partial(request.out, request.flat)  # this run's only: check refused anything else
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    print(summary(request, counts, total, seconds, prepare.workers_for(request, spec)))
    return 0
