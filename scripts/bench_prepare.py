"""Measure data preparation: tokenizing text or a Parquet corpus, with a BPE
tokenizer.json or bytes, and checking a prepared corpus's ids at load.

    python scripts/bench_prepare.py --mb 100 --workers 2 --work-dir /tmp/bench-prepare
    python scripts/bench_prepare.py --input-format parquet --tokenizer bytes --mb 1100 \\
        --work-dir /tmp/bench-parquet

--tokenizer bpe trains a byte-level BPE tokenizer on the standard library
corpus first (make_tokenizer.py). Text input: --mb megabytes of text as
files of the corpus's bytes (repeated as needed). Parquet input: Parquet
files (128 MB of text each, row groups of 1,000 documents) until they hold
--mb megabytes on disk, documents of 200 B to 16 kB cut at random offsets
from the standard library's top-level sources; they are written a row group
at a time, in a process of their own whose peak resident memory (VmHWM) is
reported too. Then prepare_data.py runs on the input in its own process:
its MB/s of input, its CPU time, and its peak resident memory, both as
ru_maxrss of that process (os.wait4; it includes this process's resident
size when it started, kept small for that reason) and as the peak it reports
itself (VmHWM). Last, times the id check that train.py runs before
compiling (data.check) and scales it to 10 GB of text. A benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SCRIPTS = ROOT / "scripts"


def write_text(out: Path, megabytes: float, file_mb: float = 0.25) -> int:
    from zero_jax.data import corpus as corpus_lib

    corpus = bytes(corpus_lib.stdlib_corpus().train[0].tokens)
    total, i = int(megabytes * 1e6), 0
    out.mkdir(parents=True)
    written = 0
    while written < total:
        size = min(int(file_mb * 1e6), total - written)
        start = (i * 7_919_993) % max(1, len(corpus) - size)
        (out / f"{i:05d}.txt").write_bytes(corpus[start:start + size])
        written, i = written + size, i + 1
    return written


def write_parquet(out: Path, megabytes: float, file_mb: float = 128.0,
                  group_rows: int = 1000) -> dict:
    """Parquet files of documents (200 B to 16 kB of Python source each)
    until they hold `megabytes` on disk; their counts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zero_jax.runtime import procmem

    source = b"".join(p.read_bytes()
                      for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    rng = np.random.default_rng(0)
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    out.mkdir(parents=True)
    counts = {"files": 0, "row_groups": 0, "documents": 0, "text_bytes": 0, "parquet_bytes": 0}
    while counts["parquet_bytes"] < megabytes * 1e6:
        path = out / f"part-{counts['files']:05d}.parquet"
        with pq.ParquetWriter(path, schema) as writer:
            in_file = 0
            while in_file < file_mb * 1e6:
                sizes = rng.integers(200, 16_000, group_rows)
                starts = rng.integers(0, len(source) - 16_000, group_rows)
                docs = [source[s:s + n].decode("utf-8", "replace") for s, n in zip(starts, sizes)]
                ids = np.arange(group_rows) + counts["documents"]
                writer.write_table(pa.table({"id": ids, "text": docs}, schema))
                in_file += int(sizes.sum())
                counts["row_groups"] += 1
                counts["documents"] += group_rows
        counts["files"] += 1
        counts["text_bytes"] += in_file
        counts["parquet_bytes"] += path.stat().st_size
    counts["writer_peak_resident_mb"] = round(procmem.resident("VmHWM") / 2 ** 20)
    return counts


def make_inputs(args, work: Path) -> tuple[str, dict]:
    """The --input glob and what was written; Parquet in a process of its own."""
    if args.input_format == "text":
        return f"{work}/text/*.txt", {"text_bytes": write_text(work / "text", args.mb)}
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        counts = pool.apply(write_parquet, (work / "parquet", args.mb))
    return f"{work}/parquet/*.parquet", counts


def run_prepare(args, work: Path, pattern: str, tokenizer) -> tuple[str, os.struct_rusage]:
    """prepare_data.py's summary line and its process's resource usage."""
    with open(work / "prepare.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, SCRIPTS / "prepare_data.py", "--input", pattern,
                                 "--tokenizer", tokenizer, "--out", work / "data",
                                 "--workers", str(args.workers), "--no-progress"],
                                stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        lines = log.read().strip().splitlines()
    if proc.returncode:
        raise SystemExit("\n".join(lines))
    return lines[-1], usage


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0,
                   help="megabytes of input: of text, or of Parquet files on disk")
    p.add_argument("--input-format", choices=("text", "parquet"), default="text",
                   help="the generated input: text files or Parquet files (default: %(default)s)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="prepare_data.py worker processes (default: the CPU count)")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="vocabulary of the tokenizer --tokenizer bpe trains (default: %(default)s)")
    p.add_argument("--tokenizer", choices=("bpe", "bytes"), default="bpe",
                   help="a BPE tokenizer.json trained here, or the byte-level default")
    p.add_argument("--work-dir", required=True, help="scratch directory (removed first)")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokenizer = "bytes"
    if args.tokenizer == "bpe":
        tokenizer = work / "tok"
        subprocess.run([sys.executable, SCRIPTS / "make_tokenizer.py", "--out", tokenizer,
                        "--vocab-size", str(args.vocab_size)], check=True)
    pattern, written = make_inputs(args, work)
    started = time.perf_counter()
    line, usage = run_prepare(args, work, pattern, tokenizer)
    seconds = time.perf_counter() - started
    print(line)
    result = {"tokenizer": args.tokenizer, "input_format": args.input_format,
              "workers": args.workers, **written, "prepare_s": round(seconds, 1),
              "input_mb_per_s": float(re.search(r"\(([\d.]+) MB/s", line).group(1)),
              "text_mb_per_s": round(written["text_bytes"] / 1e6 / seconds, 1),
              # CPU time, which a shared machine's load does not stretch as it does wall time
              "prepare_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
              "prepare_ru_maxrss_mb": round(usage.ru_maxrss / 1024),
              "peak_resident_mb": {who: float(mb) for mb, who in
                                   re.findall(r"(\d+) MB in (this process|a worker)", line)}}
    print(json.dumps({**result, **check_ids(work / "data", written["text_bytes"])}))
    return 0


def check_ids(data_dir: Path, text_bytes: int) -> dict:
    """The time of train.py's id check over the prepared corpus."""
    from zero_jax.data import corpus as corpus_lib  # JAX, imported after the runs above

    data = corpus_lib.load(str(data_dir))
    tokens = data.tokens("train") + data.tokens("val")
    started = time.perf_counter()
    corpus_lib.check(data, data.vocab_size, 128)
    check_s = time.perf_counter() - started
    ids_bytes = tokens * data.train[0].tokens.dtype.itemsize
    return {"tokens": tokens, "bytes_per_token": round(text_bytes / tokens, 3),
            "check_s": round(check_s, 3),
            "check_gb_of_ids_per_s": round(ids_bytes / 1e9 / check_s, 2),
            "check_s_for_10gb_text": round(check_s * 10e9 / text_bytes, 1)}


if __name__ == "__main__":
    sys.exit(main())
