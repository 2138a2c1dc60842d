"""Corpora and deterministic, process-local batches."""

import json

import jax
import numpy as np
import pytest

from zero_jax.data import corpus as corpus_lib
from zero_jax.data import sampler
from zero_jax.sharding import mesh as mesh_lib
from jax.sharding import NamedSharding, PartitionSpec as P


def test_stdlib_corpus_is_the_standard_library_source(corpus):
    total = corpus.tokens("train") + corpus.tokens("val")
    assert 5e6 < total < 5e7 and corpus.vocab_size == 256 and not corpus.masked
    assert 0.02 < corpus.tokens("val") / total < 0.10
    text = bytes(corpus.train[0].tokens[:100_000]).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert corpus.documents("train") > 500  # one per file


def test_batches_are_a_pure_function_of_seed_and_step(corpus):
    rows = np.arange(8)
    rows_of = lambda seed, step, rows: corpus_lib.batch_rows(corpus, "train", 16, 8, seed, step,
                                                           rows)["tokens"]
    a, b, c, d = rows_of(0, 5, rows), rows_of(0, 5, rows), rows_of(0, 6, rows), rows_of(1, 5, rows)
    mask = corpus_lib.batch_rows(corpus, "train", 16, 8, 0, 5, rows)["loss_mask"]
    assert a.shape == (8, 17) and a.dtype == np.int32 and mask.all()
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and (a != d).any()
    # Any set of rows is the same rows of the whole batch: what a process builds.
    part = rows_of(0, 5, np.array([1, 2, 6]))
    np.testing.assert_array_equal(part, a[[1, 2, 6]])
    # Row r reads window sampler.windows(...)[r]: seq_len + 1 tokens from a multiple of seq_len.
    stream = corpus.train[0].tokens
    n = (len(stream) - 1) // 16
    for row, w in zip(a, sampler.windows(n, 0, "train", 5, 8, rows)):
        np.testing.assert_array_equal(row, stream[w * 16:w * 16 + 17])


def test_global_batch_is_the_same_whatever_the_layout(corpus):
    mesh, _ = mesh_lib.build_mesh(mesh_lib.parse_inline("data=2,fsdp=4"))
    sharded = NamedSharding(mesh, P(("data", "fsdp")))
    x = corpus_lib.global_batch(corpus, "train", 16, 16, 0, 3, sharded)
    one = NamedSharding(mesh_lib.build_mesh(mesh_lib.parse_inline("fsdp=1"), jax.devices()[:1])[0], P())
    y = corpus_lib.global_batch(corpus, "train", 16, 16, 0, 3, one)
    for key in ("tokens", "weights"):
        np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key]))
        assert x[key].sharding == sharded
    np.testing.assert_array_equal(corpus_lib.device_rows(sharded, (16, 17)), np.arange(16))


def test_token_file_with_and_without_vocab_sidecar(tmp_path):
    ids = (np.arange(10_000) % 1000).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    data = corpus_lib.load(str(path))
    assert data.vocab_size == 1000 and data.tokens("train") + data.tokens("val") == 10_000
    (tmp_path / "tokens.bin.json").write_text(json.dumps({"vocab_size": 50257}))
    assert corpus_lib.load(str(path)).vocab_size == 50257
    batch = corpus_lib.batch_rows(data, "train", 32, 4, 0, 0, np.arange(4))["tokens"]
    assert ((batch[:, 1:] - batch[:, :-1]) % 1000 == 1).all()  # consecutive tokens


def test_bad_token_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such token file"):
        corpus_lib.load(str(tmp_path / "missing.bin"))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        corpus_lib.load(str(odd))
