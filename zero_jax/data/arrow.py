"""Parquet files and Arrow datasets as a stream of records, for prepare.py.

Public corpora ship as Parquet (the Hugging Face hub's own format) or as the
directories `datasets.Dataset.save_to_disk` writes:

    DATASET/state.json              {"_data_files": [{"filename": ...}, ...], ...}
    DATASET/dataset_info.json       features, description
    DATASET/data-00000-of-00002.arrow   record batches, Arrow IPC stream format

A Parquet file is read a record batch of about `batch_bytes` of its chosen
columns at a time, its column chunks streamed through a READ_BUFFER, and an
Arrow file one record batch at a time, as it was written: memory stays flat
whatever the size of the corpus (or of a Parquet row group). pyarrow is
imported only when a table is read, so text and JSON lines need none.
Errors are ValueErrors naming the input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

PARQUET, ARROW = ".parquet", ".arrow"
STRING_TYPES = ("string", "large_string", "string_view")
INSTALL = "pip install 'zero-jax[data]'"
READ_BUFFER = 1 << 20  # bytes of a Parquet column chunk read at a time


def is_table(path: Path) -> bool:
    """Whether `path` is read as a table (by its suffix): Parquet or Arrow."""
    return path.suffix in (PARQUET, ARROW)


def dataset_files(directory: Path) -> tuple[Path, ...] | None:
    """The Arrow files of a save_to_disk directory, in the dataset's order
    (state.json), or of a directory of *.arrow files (by name); None when
    `directory` is neither."""
    state = directory / "state.json"
    if state.is_file():
        try:
            files = [directory / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--input {directory}: state.json does not list the dataset's "
                             f"files in _data_files ({e})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"--input {directory}: state.json lists {', '.join(missing)}, "
                             "which are not there")
        return tuple(files)
    if (directory / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: one per split
        splits = sorted(d.name for d in directory.iterdir() if (d / "state.json").is_file())
        raise ValueError(f"--input {directory}: a dataset of several splits; give one of them "
                         f"(--input {directory / (splits[0] if splits else 'SPLIT')})")
    return tuple(sorted(directory.glob(f"*{ARROW}"))) or None


def _pyarrow(path: Path):
    try:
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"--input {path}: reading Parquet and Arrow needs pyarrow: "
                         f"{INSTALL}") from None
    return pyarrow


def _unreadable(path: Path, e: Exception) -> ValueError:
    kind = "Parquet" if path.suffix == PARQUET else "Arrow IPC"
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return ValueError(f"--input {path}: not a readable {kind} file ({first})")


def columns(path: Path) -> dict[str, str]:
    """The table's columns and their Arrow types ("string", "list<...>", ...),
    read from the Parquet footer or the Arrow schema alone."""
    pa = _pyarrow(path)
    try:
        if path.suffix == PARQUET:
            schema = pa.parquet.read_schema(path)
        else:
            with pa.OSFile(str(path)) as f, _ipc_reader(pa, f) as reader:
                schema = reader.schema
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None
    return {field.name: str(field.type) for field in schema}


def _ipc_reader(pa, f):
    """The IPC stream format (what save_to_disk writes) or the file format
    (pyarrow.ipc.new_file, Feather v2), told apart by the file's magic."""
    magic = f.read(6)
    f.seek(0)
    return pa.ipc.open_file(f) if magic == b"ARROW1" else pa.ipc.open_stream(f)


def records(path: Path, names: list[str], batch_bytes: int) -> Iterator[tuple[dict[str, Any], int]]:
    """(record, bytes of the file it stands for) of every row, in order, each
    record {column: Python value} of the columns `names` (structs become
    dicts, lists lists: what json.loads gives for the same row). The bytes
    add up to the file's size, spread evenly over the rows of each batch."""
    pa = _pyarrow(path)
    size, done, last = path.stat().st_size, 0, None
    batches = _parquet_batches if path.suffix == PARQUET else _arrow_batches
    try:
        for batch, fraction in batches(pa, path, names, batch_bytes):
            upto, rows = round(size * fraction), batch.to_pylist()
            for i, row in enumerate(rows):
                if last is not None:
                    yield last
                last = row, (upto - done) * (i + 1) // len(rows) - (upto - done) * i // len(rows)
            done = upto
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None
    if last is not None:  # what follows the last batch (a footer, the end of stream)
        yield last[0], last[1] + size - done


def _parquet_batches(pa, path: Path, names: list[str], batch_bytes: int):
    """(batch, share of the file read so far): rows counted against the footer's."""
    # Without pre_buffer (pyarrow's default), which reads every row group's
    # chunks before the first batch: the whole file. The buffer streams a
    # row group's column chunk, which can be hundreds of megabytes.
    with pa.parquet.ParquetFile(path, pre_buffer=False, buffer_size=READ_BUFFER) as f:
        meta, rows = f.metadata, 0
        if meta.num_rows == 0:
            return
        # Rows per batch from the chosen columns' bytes per row, so that a
        # batch of long documents is no larger than one of short ones.
        chunks = (meta.row_group(g).column(c) for g in range(meta.num_row_groups)
                  for c in range(meta.num_columns))
        wanted = sum(c.total_uncompressed_size for c in chunks
                     if c.path_in_schema.split(".")[0] in names)
        per_row = max(1, wanted // meta.num_rows)
        # One thread: the tokenizer workers hold the cores, and a pool of
        # decoding threads costs resident memory (30 MB here) without speed.
        for batch in f.iter_batches(batch_size=max(1, batch_bytes // per_row), columns=names,
                                    use_threads=False):
            rows += batch.num_rows
            if batch.num_rows:
                yield batch, rows / meta.num_rows


def _arrow_batches(pa, path: Path, names: list[str], batch_bytes: int):
    """(batch, share of the file read so far): the file's position, for a
    stream; batches counted, for the file format."""
    del batch_bytes  # an IPC batch is read whole, as written
    size = path.stat().st_size
    with pa.OSFile(str(path)) as f, _ipc_reader(pa, f) as reader:
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            n = reader.num_record_batches
            batches = ((reader.get_batch(i), (i + 1) / n) for i in range(n))
        else:
            batches = ((b, f.tell() / size) for b in reader)
        for batch, fraction in batches:
            if batch.num_rows:
                yield batch.select(names), fraction
