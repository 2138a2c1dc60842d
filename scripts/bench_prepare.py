"""Measure data preparation: tokenizing text with a BPE tokenizer.json, and
checking a prepared corpus's ids at load.

    python scripts/bench_prepare.py --mb 100 --workers 2 --work-dir /tmp/bench-prepare

Trains a byte-level BPE tokenizer on the standard library corpus
(make_tokenizer.py), writes --mb megabytes of text as files of the corpus's
bytes (repeated as needed), runs prepare_data.py on them in its own process
and reads its MB/s and peak resident memory, then times the id check that
train.py runs before compiling (data.check) and scales it to 10 GB of text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zero_jax.data import corpus as data_lib  # noqa: E402


def write_text(out: Path, megabytes: float, file_mb: float = 0.25) -> int:
    corpus = bytes(data_lib.stdlib_corpus().train[0].tokens)
    total, i = int(megabytes * 1e6), 0
    out.mkdir(parents=True)
    written = 0
    while written < total:
        size = min(int(file_mb * 1e6), total - written)
        start = (i * 7_919_993) % max(1, len(corpus) - size)
        (out / f"{i:05d}.txt").write_bytes(corpus[start:start + size])
        written, i = written + size, i + 1
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="megabytes of text to tokenize")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--tokenizer", choices=("bpe", "bytes"), default="bpe",
                   help="a BPE tokenizer.json trained here, or the byte-level default")
    p.add_argument("--work-dir", required=True, help="scratch directory (removed first)")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    scripts = ROOT / "scripts"
    tokenizer = "bytes"
    if args.tokenizer == "bpe":
        tokenizer = work / "tok"
        subprocess.run([sys.executable, scripts / "make_tokenizer.py", "--out", tokenizer,
                        "--vocab-size", str(args.vocab_size)], check=True)
    size = write_text(work / "text", args.mb)
    run = subprocess.run([sys.executable, scripts / "prepare_data.py", "--input",
                          f"{work}/text/*.txt", "--tokenizer", tokenizer, "--out", work / "data",
                          "--workers", str(args.workers), "--no-progress"],
                         capture_output=True, text=True)
    if run.returncode:
        print(run.stderr, file=sys.stderr)
        return run.returncode
    line = run.stdout.strip().splitlines()[-1]
    print(line)
    rate = float(re.search(r"\(([\d.]+) MB/s", line).group(1))
    peak = {who: float(mb) for mb, who in re.findall(r"(\d+) MB in (this process|a worker)", line)}
    data = data_lib.load(str(work / "data"))
    tokens = data.tokens("train") + data.tokens("val")
    started = time.perf_counter()
    data_lib.check(data, data.vocab_size, 128)
    check_s = time.perf_counter() - started
    ids_bytes = tokens * data.train[0].tokens.dtype.itemsize
    result = {"tokenizer": args.tokenizer, "text_mb": size / 1e6, "workers": args.workers,
              "tokens": tokens,
              "bytes_per_token": round(size / tokens, 3), "tokenize_mb_per_s": rate,
              "peak_resident_mb": peak, "check_s": round(check_s, 3),
              "check_gb_of_ids_per_s": round(ids_bytes / 1e9 / check_s, 2),
              "check_s_for_10gb_text": round(check_s * 10e9 / size, 1)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
