"""Parquet files and Arrow datasets as inputs of prepare-data
(zero_jax/data/arrow.py, prepare.py): the same documents give the same
shards as JSON lines, read batch by batch; bad inputs are one line naming
the flag. The inputs are written here with pyarrow, in the formats Hugging
Face `datasets` reads and writes (save_to_disk: Arrow IPC streams listed in
state.json)."""

import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zero_jax.cli import prepare_data
from zero_jax.data import arrow
from zero_jax.data import corpus as corpus_lib

ROOT = Path(__file__).resolve().parent.parent
# Documents of many lengths, with lines, non-ASCII text and an empty one.
DOCS = [f"Document {i}: " + "lorem ipsum dolor, " * (i % 13) + "été, 東京\nend." * (i % 3)
        for i in range(60)] + [""]
CHATS = [{"prompt": f"What is {i} + {i}?", "response": f"It is {2 * i}."} for i in range(30)] + [
    {"system": "Be brief.", "prompt": "Hi", "response": "Hello!"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                  {"role": "assistant", "content": "Goodbye."}]}]
# A table has every column in every row: null where a record has no such field.
CHAT_SCHEMA = pa.schema([
    ("prompt", pa.string()), ("response", pa.string()), ("system", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
# Only the first document validates (the split hashes each input file's name,
# and a JSON lines file has another name than a Parquet file), so two
# preparations of the same documents in the same order must match byte for byte.
FIRST_ONLY = ("--val-fraction", "1e-9", "--shard-tokens", "400")


def prepare(*args) -> None:
    assert prepare_data.main([*map(str, args), "--no-progress"]) == 0


def jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def parquet_files(d: Path, records, files: int = 3, row_group: int = 4, schema=None) -> Path:
    """`records` in `files` Parquet files of `row_group` rows per row group."""
    d.mkdir()
    cut = np.array_split(np.arange(len(records)), files)
    for k, rows in enumerate(cut):
        table = pa.Table.from_pylist([records[i] for i in rows], schema)
        pq.write_table(table, d / f"part-{k:05d}.parquet", row_group_size=row_group)
        assert pq.ParquetFile(d / f"part-{k:05d}.parquet").num_row_groups > 1
    return d


def save_to_disk(d: Path, records, files: int = 2, batch: int = 5, schema=None) -> Path:
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC streams in
    batches, listed in state.json, beside dataset_info.json."""
    d.mkdir(parents=True)
    table = pa.Table.from_pylist(records, schema)
    names = [f"data-{k:05d}-of-{files:05d}.arrow" for k in range(files)]
    for name, rows in zip(names, np.array_split(np.arange(len(records)), files)):
        part = table.slice(int(rows[0]), len(rows))
        with pa.OSFile(str(d / name), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            for b in part.to_batches(max_chunksize=batch):
                w.write_batch(b)
    (d / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": "train"}))
    (d / "dataset_info.json").write_text(json.dumps({"features": {}, "splits": {}}))
    return d


def shard_files(out: Path) -> dict[str, bytes]:
    """Every file prepare wrote but meta.json, and meta.json's splits."""
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "meta.json"}
    files["splits"] = json.dumps(json.loads((out / "meta.json").read_text())["splits"]).encode()
    return files


@pytest.fixture(scope="module")
def text_reference(tmp_path_factory):
    """DOCS as JSON lines, field "body", prepared."""
    d = tmp_path_factory.mktemp("jsonl")
    path = jsonl(d / "docs.jsonl", [{"body": t, "n": i} for i, t in enumerate(DOCS)])
    prepare("--input", path, "--text-field", "body", "--out", d / "out", *FIRST_ONLY)
    return d / "out"


def test_parquet_by_glob_gives_the_shards_of_json_lines(text_reference, tmp_path):
    d = parquet_files(tmp_path / "pq", [{"n": i, "body": t} for i, t in enumerate(DOCS)])
    prepare("--input", f"{d}/*.parquet", "--text-field", "body", "--out", tmp_path / "out",
            *FIRST_ONLY)
    ours = shard_files(tmp_path / "out")
    assert len([n for n in ours if n.startswith("train-")]) > 2  # several shards compared
    assert ours == shard_files(text_reference)
    meta = json.loads((tmp_path / "out/meta.json").read_text())
    assert meta["inputs"] == [str(d / f"part-{k:05d}.parquet") for k in range(3)]


@pytest.mark.parametrize("store", ["save_to_disk", "arrow_files"])
def test_arrow_datasets_give_the_shards_of_json_lines(text_reference, tmp_path, store):
    records = [{"body": t, "n": i} for i, t in enumerate(DOCS)]
    if store == "save_to_disk":
        d = save_to_disk(tmp_path / "ds", records)
    else:  # a directory of Arrow files in the IPC file format, read in name order
        d = tmp_path / "arrows"
        d.mkdir()
        for k, rows in enumerate(np.array_split(np.arange(len(records)), 3)):
            with pa.ipc.new_file(d / f"{k}.arrow", pa.schema([("body", pa.string()),
                                                              ("n", pa.int64())])) as w:
                w.write_table(pa.Table.from_pylist([records[i] for i in rows]), max_chunksize=4)
    prepare("--input", d, "--text-field", "body", "--out", tmp_path / "out", *FIRST_ONLY)
    assert shard_files(tmp_path / "out") == shard_files(text_reference)


def test_chat_rows_give_the_shards_of_chat_json_lines(tmp_path):
    """Rows of a messages column (a list of {role, content} structs) or of
    prompt, response and system columns (null where a row has none) render
    and mask as the same records do as JSON lines."""
    prepare("--format", "chat", "--input", jsonl(tmp_path / "sft.jsonl", CHATS),
            "--out", tmp_path / "ref", *FIRST_ONLY)
    d = parquet_files(tmp_path / "pq", CHATS, files=2, schema=CHAT_SCHEMA)
    prepare("--format", "chat", "--input", f"{d}/*.parquet", "--out", tmp_path / "pq-out",
            *FIRST_ONLY)
    save_to_disk(tmp_path / "ds", CHATS, schema=CHAT_SCHEMA)
    prepare("--format", "chat", "--input", tmp_path / "ds", "--out", tmp_path / "ds-out",
            *FIRST_ONLY)
    reference = shard_files(tmp_path / "ref")
    assert any(n.endswith(".mask") for n in reference)
    assert shard_files(tmp_path / "pq-out") == reference == shard_files(tmp_path / "ds-out")


def test_rows_are_numbered_across_row_groups_for_the_split(tmp_path):
    """A row's index in the split rule counts from 1 through the whole file,
    as a JSON line's does, not from each row group or batch."""
    d = parquet_files(tmp_path / "pq", [{"text": t} for t in DOCS])
    prepare("--input", f"{d}/*.parquet", "--out", tmp_path / "out", "--val-fraction", 0.3)
    data = corpus_lib.load(str(tmp_path / "out"))
    expected = [DOCS[i] for k, rows in enumerate(np.array_split(np.arange(len(DOCS)), 3))
                for n, i in enumerate(rows, 1)
                if zlib.crc32(f"part-{k:05d}.parquet\0{n}".encode()) < 0.3 * 2 ** 32 or i == 0]
    ids = np.concatenate([s.tokens for s in data.val])
    texts = [bytes(doc[doc < 256].astype(np.uint8)).decode()
             for doc in np.split(ids, np.flatnonzero(ids == 256) + 1)[:-1]]
    assert 3 < len(expected) < len(DOCS) - 3 and texts == expected


def test_records_account_for_every_byte_whatever_the_batch(tmp_path):
    d = parquet_files(tmp_path / "pq", [{"n": i, "text": t} for i, t in enumerate(DOCS)], files=1)
    path = d / "part-00000.parquet"
    for batch_bytes in (1, 200, 1 << 20):  # one row, a few, the whole file per batch
        rows = list(arrow.records(path, ["text"], batch_bytes))
        assert [r for r, _ in rows] == [{"text": t} for t in DOCS]
        assert sum(n for _, n in rows) == path.stat().st_size and min(n for _, n in rows) >= 0
    ds = save_to_disk(tmp_path / "ds", [{"text": t} for t in DOCS], files=1)
    arrow_file = arrow.dataset_files(ds)[0]
    rows = list(arrow.records(arrow_file, ["text"], 1 << 20))
    assert [r["text"] for r, _ in rows] == DOCS
    assert sum(n for _, n in rows) == arrow_file.stat().st_size


def test_a_table_is_read_a_batch_at_a_time(tmp_path):
    """What pyarrow allocates while the records of a 24 MB table are read
    stays under half of it: with many row groups, with one, and for an
    Arrow stream. (pyarrow's default, pre-buffering, holds the whole file.)"""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    \n", np.uint8)
    text = letters[rng.integers(0, len(letters), 6000 * 4000)].tobytes().decode()
    table = pa.table({"text": [text[i:i + 4000] for i in range(0, len(text), 4000)]})
    paths = {"many": tmp_path / "many.parquet", "one": tmp_path / "one.parquet",
             "stream": tmp_path / "stream.arrow"}
    pq.write_table(table, paths["many"], row_group_size=256)
    pq.write_table(table, paths["one"], row_group_size=len(table))
    with pa.OSFile(str(paths["stream"]), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=256)
    del table
    for name, path in paths.items():
        before = pa.total_allocated_bytes()
        peak = max(pa.total_allocated_bytes() for _ in arrow.records(path, ["text"], 1 << 20))
        assert peak - before < len(text) / 2, name


def refused(capsys, *args) -> str:
    """The one line a bad invocation prints; it exits 2."""
    assert prepare_data.main([*map(str, args), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_a_glob_that_matches_nothing_is_refused(tmp_path, capsys):
    assert refused(capsys, "--input", f"{tmp_path}/*.parquet", "--out", tmp_path / "out") == (
        f"error: --input {tmp_path}/*.parquet: the glob matches no file")
    assert not (tmp_path / "out").exists()


def test_a_missing_text_column_is_refused_listing_the_columns(tmp_path, capsys):
    d = parquet_files(tmp_path / "pq", [{"body": t, "n": 1} for t in DOCS])
    line = refused(capsys, "--input", f"{d}/*.parquet", "--out", tmp_path / "out")
    assert line == (f"error: --text-field text: {d}/part-00000.parquet has no such column; "
                    "its columns: body (string), n (int64)")
    line = refused(capsys, "--input", f"{d}/*.parquet", "--text-field", "n", "--out",
                   tmp_path / "out")
    assert line.startswith("error: --text-field n: ") and "int64, not strings" in line
    ds = save_to_disk(tmp_path / "ds", [{"body": t} for t in DOCS])
    line = refused(capsys, "--input", ds, "--out", tmp_path / "out")
    assert line == (f"error: --text-field text: {ds}/data-00000-of-00002.arrow has no such "
                    "column; its columns: body (string)")
    line = refused(capsys, "--format", "chat", "--input", ds, "--out", tmp_path / "out")
    assert line.startswith(f"error: --input {ds}/data-00000-of-00002.arrow: chat data needs a "
                           "column 'messages'") and "its columns: body (string)" in line
    assert not (tmp_path / "out").exists()


def test_a_directory_that_is_no_dataset_is_refused(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain/a.txt").write_text("text")
    assert refused(capsys, "--input", tmp_path / "plain", "--out", tmp_path / "out") == (
        f"error: --input {tmp_path}/plain: a directory, but not a datasets save_to_disk "
        "directory (state.json) or one of *.arrow files; give files or a glob")
    # DatasetDict.save_to_disk: a directory per split, which one is for the user to say.
    save_to_disk(tmp_path / "dict" / "train", [{"text": t} for t in DOCS])
    (tmp_path / "dict/dataset_dict.json").write_text('{"splits": ["train"]}')
    assert refused(capsys, "--input", tmp_path / "dict", "--out", tmp_path / "out") == (
        f"error: --input {tmp_path}/dict: a dataset of several splits; give one of them "
        f"(--input {tmp_path}/dict/train)")
    (tmp_path / "dict/train/data-00001-of-00002.arrow").unlink()
    line = refused(capsys, "--input", tmp_path / "dict/train", "--out", tmp_path / "out")
    assert "state.json lists data-00001-of-00002.arrow, which are not there" in line


def test_a_file_that_is_no_parquet_is_refused(tmp_path, capsys):
    (tmp_path / "fake.parquet").write_text("not parquet at all\n")
    line = refused(capsys, "--input", tmp_path / "fake.parquet", "--out", tmp_path / "out")
    assert line.startswith(f"error: --input {tmp_path}/fake.parquet: not a readable Parquet file")


def test_without_pyarrow_a_table_input_asks_for_the_data_extra(tmp_path):
    """pyarrow made unimportable in a fresh interpreter: text still prepares,
    a Parquet input is one line naming the extra to install."""
    d = parquet_files(tmp_path / "pq", [{"text": t} for t in DOCS])
    (tmp_path / "a.txt").write_text("some text\n" * 10)
    (tmp_path / "b.txt").write_text("more text\n" * 10)
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "from zero_jax.cli import prepare_data\n"
            "sys.exit(prepare_data.main(sys.argv[1:] + ['--no-progress']))")

    def run(*args):
        return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    text = run("--input", f"{tmp_path}/*.txt", "--out", tmp_path / "text-out")
    assert text.returncode == 0, text.stderr
    p = run("--input", f"{d}/*.parquet", "--out", tmp_path / "out")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: --input {d}/part-00000.parquet: reading Parquet and Arrow needs pyarrow: "
        "pip install 'zero-jax[data]'"]
