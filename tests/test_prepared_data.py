"""Prepared corpora (zero_jax/data/prepare.py, token_files.py): tokenized
documents in shards, chat data with a loss mask, bad data refused before
anything compiles, the same batches on every layout and process count, and
a masked loss that any microbatching gives alike."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.helpers import assert_close, initial_state, make_job, train
from zero_jax import loop, run
from zero_jax.cli import prepare_data
from zero_jax.data import corpus as corpus_lib
from zero_jax.data import prepare as prepare_lib
from zero_jax.data import sampler
from zero_jax.data import token_files
from zero_jax.data import tokenizers as tokenizers_lib
from zero_jax.data import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent


ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def prepare(*args) -> None:
    assert prepare_data.main([*map(str, args), "--no-progress"]) == 0


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """150 standard-library files copied as .txt, one document each."""
    d = tmp_path_factory.mktemp("texts")
    for i, path in enumerate(sorted(Path(os.__file__).parent.glob("*.py"))[:150]):
        (d / f"{i:03d}.txt").write_bytes(path.read_bytes())
    return d


@pytest.fixture(scope="module")
def text_data(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "bytes"
    prepare("--input", f"{texts}/*.txt", "--out", out, "--workers", 1, "--val-fraction", 0.1)
    return out


CHATS = [{"prompt": f"What is {i} + {i}?", "response": f"It is {2 * i}."} for i in range(40)] + [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                  {"role": "assistant", "content": "Goodbye."}]}]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    return path


@pytest.fixture(scope="module")
def sft(chat_file, tmp_path_factory):
    """The chat records prepared with the byte tokenizer and plain template."""
    out = tmp_path_factory.mktemp("prepared") / "sft"
    prepare("--format", "chat", "--input", chat_file, "--out", out, "--val-fraction", 0.1,
            "--workers", 1)
    return out


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer.json with a ChatML template, trained here."""
    d = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer.write(d, vocab_size=512, sample_bytes=500_000, chat=True)
    return d


def test_the_order_is_a_fixed_bijection():
    # Pinned: a change here changes every run's data order (rename sampler.ORDER).
    assert sampler.permute(np.arange(10), 10, sampler.key(0, 0, 0)).tolist() == \
        [1, 7, 3, 6, 0, 2, 8, 4, 9, 5]
    for n in (1, 2, 3, 17, 1000, 4097):
        for seed in (0, 1):
            image = sampler.permute(np.arange(n), n, sampler.key(seed, 0, 0))
            assert sorted(image) == list(range(n))
    # Each epoch reads every window once, in a new order.
    w = sampler.windows(50, 3, "train", 0, 100, np.arange(100))
    assert sorted(w[:50]) == sorted(w[50:]) == list(range(50)) and (w[:50] != w[50:]).any()


def test_text_documents_become_shards_with_end_of_document_tokens(text_data, texts):
    meta = json.loads((text_data / "meta.json").read_text())
    assert meta["vocab_size"] == 257 and meta["dtype"] == "<u2" and meta["eos_id"] == 256
    docs = {s: meta["splits"][s]["documents"] for s in ("train", "val")}
    assert docs["train"] + docs["val"] == 150 and docs["val"] >= 5
    data = corpus_lib.load(str(text_data))
    tokens = np.asarray(data.train[0].tokens)
    assert (tokens == 256).sum() == docs["train"] == len(data.train[0].docs)
    starts = data.train[0].docs
    assert (tokens[starts[1:] - 1] == 256).all() and tokens[-1] == 256  # each document ends with it
    # The whole of each file, in order: the first train document is some file's bytes.
    first = bytes(tokens[:starts[1] - 1].astype(np.uint8))
    assert any(first == p.read_bytes() for p in texts.glob("*.txt"))
    # Bytes are split into train and validation by document, and nothing is lost.
    assert data.tokens("train") + data.tokens("val") == sum(
        p.stat().st_size + 1 for p in texts.glob("*.txt"))


def test_the_library_call_writes_what_the_command_writes(text_data, texts, tmp_path):
    """zero_jax.data.prepare without the command line: the same shards, and
    the progress callback hears of every input byte."""
    job = prepare_lib.Request(out=tmp_path / "lib", val_fraction=0.1,
                          files=prepare_lib.expand([f"{texts}/*.txt"]))
    seen = []
    counts = prepare_lib.prepare(job, tokenizers_lib.resolve(tokenizers_lib.BYTES), seen.append)
    assert sum(seen) == sum(p.stat().st_size for p in texts.glob("*.txt"))
    meta = json.loads((text_data / "meta.json").read_text())
    assert {s: c["tokens"] for s, c in counts.items()} == {
        s: meta["splits"][s]["tokens"] for s in ("train", "val")}
    ours, theirs = corpus_lib.load(str(job.out)), corpus_lib.load(str(text_data))
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate([s.tokens for s in ours.split(split)]),
                                      np.concatenate([s.tokens for s in theirs.split(split)]))


def test_worker_processes_write_the_same_shards(texts, bpe, tmp_path):
    common = ("--input", f"{texts}/0[0-3]*.txt", "--tokenizer", bpe, "--val-fraction", 0.1)
    prepare(*common, "--out", tmp_path / "one", "--workers", 1)
    prepare(*common, "--out", tmp_path / "two", "--workers", 2, "--shard-tokens", 50_000)
    one, two = corpus_lib.load(str(tmp_path / "one")), corpus_lib.load(str(tmp_path / "two"))
    assert len(two.train) > 1 and one.vocab_size == 512  # cut into shards at document ends
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate([s.tokens for s in one.split(split)]),
                                      np.concatenate([s.tokens for s in two.split(split)]))


def _masked_text(data):
    shard = data.train[0]
    return np.asarray(shard.tokens), np.asarray(shard.mask)


def test_chat_data_masks_all_but_the_assistant(chat_file, bpe, tmp_path):
    from tokenizers import Tokenizer

    prepare("--format", "chat", "--input", chat_file, "--out", tmp_path / "plain",
            "--val-fraction", 0.1, "--workers", 1)
    prepare("--format", "chat", "--input", chat_file, "--tokenizer", bpe,
            "--out", tmp_path / "chatml", "--val-fraction", 0.1, "--workers", 2)
    plain = corpus_lib.load(str(tmp_path / "plain"))
    assert plain.masked and plain.meta["tokenizer"]["chat_template"] == "plain"
    ids, mask = _masked_text(plain)
    text = bytes(ids[ids < 256].astype(np.uint8)).decode()
    assert "### User:\nWhat is" in text and "### Assistant:\nIt is" in text
    # The loss covers the answers and the end-of-document token after each, nothing else.
    learned = ids[mask == 1]
    assert bytes(learned[learned < 256].astype(np.uint8)).decode().startswith("It is")
    # One per assistant message: one per record, two in the multi-turn one.
    assert (learned == 256).sum() == plain.documents("train") + ("Goodbye." in text)
    assert "What is" not in bytes(learned[learned < 256].astype(np.uint8)).decode()

    chatml = corpus_lib.load(str(tmp_path / "chatml"))
    assert chatml.meta["tokenizer"]["chat_template"] == "model's"
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    ids, mask = _masked_text(chatml)
    whole = tok.decode(ids.tolist(), skip_special_tokens=False)
    answers = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is" in whole and "<|im_start|>assistant\nIt is" in whole
    assert answers.startswith("It is") and "<|im_end|>" in answers
    assert "user" not in answers and "What is" not in answers


def test_large_vocabulary_is_stored_in_uint32_and_trains(tmp_path):
    """Ids up to 151,935 (Qwen2's vocabulary) in uint32 shards: llama-tiny's
    layers with that vocabulary (a narrower residual, for the suite's time)
    train three finite steps."""
    vocab = 151_936
    rng = np.random.default_rng(0)
    w = {s: token_files.SplitWriter(tmp_path, s, token_files.dtype_for(vocab), 1 << 20, False)
         for s in token_files.SPLITS}
    for i in range(60):
        w["val" if i % 10 == 0 else "train"].add(rng.integers(0, vocab, 200).astype(np.uint32))
    counts = {s: x.close() for s, x in w.items()}
    token_files.write_meta(tmp_path, {"vocab_size": vocab, "dtype": "<u4", "eos_id": vocab - 1,
                                 "splits": counts})
    data = corpus_lib.load(str(tmp_path))
    assert data.train[0].tokens.dtype == np.uint32 and int(data.train[0].tokens.max()) > 1 << 16
    job = make_job(data, model="llama-tiny", seq_len=16, batch_size=8, steps=3, d_model=64)
    assert job.model.config.vocab_size == vocab
    corpus_lib.check(data, vocab, 16)
    losses, _ = train(job, data)
    assert np.isfinite(losses).all() and losses[0] == pytest.approx(np.log(vocab), rel=0.05)


def _corrupt(root: Path, how: str) -> None:
    meta = json.loads((root / "meta.json").read_text())
    shard = root / "train-00000.tokens"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-6])
    elif how == "longer":
        shard.write_bytes(shard.read_bytes() + b"\0\0")
    elif how == "missing":
        (root / "val-00000.tokens").unlink()
    elif how == "empty":
        meta["splits"]["val"]["shards"][0]["tokens"] = 0
    elif how == "no split":
        meta["splits"]["val"]["shards"] = []
    elif how == "meta":
        (root / "meta.json").write_text("{")
        return
    elif how == "docs":
        (root / "train-00000.docs").write_bytes(np.asarray([5] * meta["splits"]["train"][
            "shards"][0]["documents"], "<i8").tobytes())
    (root / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("how,message", [
    ("truncated", r"train-00000.tokens: .* bytes, meta.json says .* \(truncated\)"),
    ("longer", r"train-00000.tokens: .* \(longer than recorded\)"),
    ("missing", r"val-00000.tokens: missing, but meta.json lists the shard"),
    ("empty", r"val-00000.tokens: an empty shard"),
    ("no split", r"the val split has no shards"),
    ("meta", r"meta.json: not valid JSON"),
    ("docs", r"train-00000.docs: document offsets are not increasing"),
])
def test_damaged_data_is_refused_naming_the_file(text_data, tmp_path, how, message):
    root = tmp_path / "copy"
    shutil.copytree(text_data, root)
    _corrupt(root, how)
    with pytest.raises(token_files.DataError, match=message):
        corpus_lib.load(str(root))


def test_data_that_does_not_fit_the_model_is_refused(texts, text_data, bpe, tmp_path):
    data = corpus_lib.load(str(text_data))
    with pytest.raises(token_files.DataError,
                       match="its tokenizer has 257 ids, the model's vocabulary 200"):
        corpus_lib.check(data, 200, 16)
    with pytest.raises(token_files.DataError, match="a sequence needs seq_len \\+ 1 = 1000001"):
        corpus_lib.check(data, 257, 1_000_000)
    prepare("--input", f"{texts}/00*.txt", "--tokenizer", bpe,
            "--out", tmp_path / "bpe", "--val-fraction", 0.2, "--workers", 1)
    tokenized = corpus_lib.load(str(tmp_path / "bpe"))
    other = tmp_path / "model"
    other.mkdir()
    (other / "tokenizer.json").write_text((bpe / "tokenizer.json").read_text().replace("<|im_end|>",
                                                                                       "<|end|>"))
    with pytest.raises(token_files.DataError, match=f"not with {other}/tokenizer.json"):
        corpus_lib.check(tokenized, 512, 16, [str(other)])
    corpus_lib.check(tokenized, 512, 16, [str(bpe)])  # the same tokenizer passes


def test_an_id_outside_the_vocabulary_stops_the_run_before_any_step(text_data, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(text_data, root)
    shard = root / "val-00000.tokens"
    ids = np.fromfile(shard, "<u2")
    ids[1234] = 300  # vocabulary 257
    ids.tofile(shard)
    with pytest.raises(token_files.DataError, match="val-00000.tokens: token offset 1,234 is id 300"):
        corpus_lib.check(corpus_lib.load(str(root)), 257, 16)
    p = subprocess.run([sys.executable, "scripts/train.py", "--data", str(root), "--seq-len", "16",
                        "--steps", "2", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                       env={**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
                       timeout=300)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"error: --data {shard}: token offset 1,234 is id 300, not below the model's vocabulary "
        "of 257; the data was tokenized for another vocabulary: prepare it with the model's "
        "tokenizer, or give the model a vocabulary that covers it (--vocab-size)"]
    assert "step" not in p.stdout


def test_flat_files_are_still_written_and_read(texts, text_data, tmp_path):
    out = tmp_path / "tokens.bin"
    prepare("--format", "flat", "--input", f"{texts}/*.txt", "--out", out, "--workers", 1)
    flat = corpus_lib.load(str(out))
    assert flat.vocab_size == 257
    prepared = corpus_lib.load(str(text_data))
    assert flat.tokens("train") + flat.tokens("val") == \
        prepared.tokens("train") + prepared.tokens("val")


def _probe(tmp_path, data, mesh, n, k):
    out = tmp_path / f"probe-{n}x{k}"
    cmd = [sys.executable, "scripts/launch.py", "-n", str(n), "--devices-per-process", str(k),
           "--", "scripts/batch_probe.py", "--data", str(data), "--mesh", str(mesh),
           "--seq-len", "16", "--batch-size", "16", "--segment-ids", "--steps-to-probe", "0,7",
           "--probe-out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = {}
    for i in range(n):
        with np.load(out / f"process-{i}.npz") as z:
            for key in z.files:
                name, step, row = key.split("/")
                got.setdefault((name, int(step)), {})[int(row)] = z[key]
    return {key: np.concatenate([blocks[r] for r in sorted(blocks)]) for key, blocks in got.items()}


def test_every_layout_and_process_count_reads_the_same_batches(sft, tmp_path):
    """fsdp=8 in one process; data=2,fsdp=4 over 2 processes x 4 devices and
    over 4 x 2, with the data axis inside each process and fsdp across
    them, so that a process's rows are not contiguous in the batch."""
    data = corpus_lib.load(str(sft))
    job = make_job(data, mesh="fsdp=8", seq_len=16, batch_size=16)
    expected = {}
    for step in (0, 7):
        batch = corpus_lib.global_batch(data, "train", 16, 16, 0, step, job.state_plan.batch_sharding,
                                      segments=True)
        for name, array in batch.items():
            expected[(name, step)] = np.asarray(array)
    weights = expected[("weights", 0)]  # the loss mask over the batch's count of targets
    assert (weights == 0).any() and weights.sum() == pytest.approx(1.0, rel=1e-6)
    meshes = {(2, 4): "[ici]\ndata = 2\nfsdp = 2\n[dcn]\nfsdp = 2\n",
              (4, 2): "[ici]\ndata = 2\n[dcn]\nfsdp = 4\n"}
    for (n, k), text in meshes.items():
        mesh = tmp_path / f"mesh-{n}x{k}.toml"
        mesh.write_text(text)
        got = _probe(tmp_path, sft, mesh, n, k)
        assert got.keys() == expected.keys()
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{n}x{k} {key}")


def _masked_batch(job, rng):
    """A batch whose loss mask keeps a different number of targets in each
    row (and so in each microbatch and each device's rows), weighted as
    data.global_batch weighs them; and the mask."""
    t = job.run.train
    shape = (t.batch_size, job.run.data.seq_len + 1)
    tokens = rng.integers(0, job.model.config.vocab_size, shape).astype(np.int32)
    keep = rng.random(shape[:1] + (shape[1] - 1,)) < np.linspace(0.05, 0.95, shape[0])[:, None]
    s = job.state_plan.batch_sharding
    weights = keep.astype(np.float32) / keep.sum()
    return {"tokens": jax.device_put(tokens, s), "weights": jax.device_put(weights, s)}, keep


def test_masked_loss_is_the_same_for_any_microbatching_and_layout(corpus):
    """With a loss mask, 1, 2 and 4 microbatches (reduced per step and per
    microbatch) and a pipeline give the loss and gradients of the whole
    batch's mean over its targets, to 1e-6; so does evaluation."""
    ref = make_job(corpus, mesh="fsdp=1", devices=jax.devices()[:1], batch_size=32, zero_stage=0)
    rng = np.random.default_rng(0)
    batch, keep = _masked_batch(ref, rng)
    params = initial_state(ref).params
    loss1, grads1 = ref.jit_loss_and_grads()(params, batch)
    # The mean over the targets, by hand.
    logits = ref.model.apply(params, batch["tokens"][:, :-1], ref.hooks)
    nll = -jax.nn.log_softmax(logits.astype(np.float32))
    targets = np.asarray(batch["tokens"][:, 1:])
    picked = np.take_along_axis(np.asarray(nll), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(loss1), (picked * keep).sum() / keep.sum(), rtol=1e-6)
    layouts = [dict(mesh="data=2,fsdp=4", zero_stage=1, microbatches=2, grad_reduce="step"),
               dict(mesh="fsdp=8", zero_stage=3, microbatches=4, grad_reduce="microbatch"),
               dict(mesh="pipe=2,fsdp=4", zero_stage=1, microbatches=4)]
    for overrides in layouts:
        job = make_job(corpus, batch_size=32, **overrides)
        b = jax.device_put(batch, job.state_plan.batch_sharding)
        loss, grads = job.jit_loss_and_grads()(initial_state(job).params, b)
        np.testing.assert_allclose(float(loss), float(loss1), rtol=1e-6, err_msg=str(overrides))
        assert_close(grads, grads1, rtol=1e-6)
    # Validation: the mean over the targets of several batches, not of their means.
    evaluate = ref.compile_eval_step()
    tokens = np.asarray(batch["tokens"])
    halves, counts = [], []
    for rows in (slice(0, 16), slice(16, 32)):
        mask = np.concatenate([keep[rows]] * 2)  # each half twice: a batch of 32 rows
        halves.append(jax.device_put({"tokens": np.concatenate([tokens[rows]] * 2),
                                      "weights": mask.astype(np.float32) / mask.sum()},
                                     ref.state_plan.batch_sharding))
        counts.append(int(mask.sum()))
    both = loop.evaluate(evaluate, params, lambda i: halves[i], 2, lambda i: counts[i])
    np.testing.assert_allclose(both, float(loss1), rtol=1e-6)


def test_resume_at_step_7_of_15_is_bitwise_the_straight_run(sft, tmp_path):
    data = corpus_lib.load(str(sft))
    common = dict(data=str(sft), seq_len=16, batch_size=8, steps=15, eval_every=0,
                  eval_batches=1)
    straight = make_job(data, **common)
    steps = run.CompiledSteps(straight.compile_train_step(), straight.compile_eval_step())
    quiet = run.Reporting(progress=False, log=lambda _: None)
    whole = run.train(straight, data, steps, reporting=quiet)
    ckpt = str(tmp_path / "ckpt")
    first = run.train(make_job(data, **common, dir=ckpt, stop_at=7), data, steps,
                      reporting=quiet)
    assert first.stopped == "stop_at" and len(first.history) == 7
    rest = run.train(make_job(data, **common, dir=ckpt, resume=True), data, steps,
                     reporting=quiet)
    assert rest.resumed_from == 7 and len(rest.history) == 8
    assert [h["loss"] for h in first.history + rest.history] == [h["loss"] for h in whole.history]
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, rest.state.params),
                 jax.tree.map(np.asarray, whole.state.params))


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_segment_ids_make_packed_documents_independent(sft, model):
    """With segment ids a row of two packed documents gives each document
    the logits it has alone (attention within it, positions from 0), and a
    sharded step gives one device's loss and gradients."""
    data = corpus_lib.load(str(sft))
    one = make_job(data, model=model, mesh="fsdp=1", devices=jax.devices()[:1], seq_len=32,
                   batch_size=8, segment_ids=True, zero_stage=0)
    params = initial_state(one).params
    apply = jax.jit(lambda p, t, s: one.model.apply(p, t, one.hooks, segments_BxT=s))
    plain = jax.jit(lambda p, t: one.model.apply(p, t, one.hooks))
    row = np.random.default_rng(0).integers(0, 256, (1, 32)).astype(np.int32)
    seg = np.asarray([[0] * 12 + [1] * 20], np.int32)
    packed = np.asarray(apply(params, row, seg))
    np.testing.assert_allclose(packed[0, :12], np.asarray(plain(params, row[:, :12]))[0],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, 12:], np.asarray(plain(params, row[:, 12:]))[0],
                               rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(plain(params, row))[0, 12:] - packed[0, 12:]).max() > 1e-3
    # The sharded step, with documents from the data's boundaries.
    sharded = make_job(data, model=model, mesh="fsdp=8", seq_len=32, batch_size=8,
                       segment_ids=True, zero_stage=3)
    batches = [corpus_lib.global_batch(data, "train", 32, 8, 0, 3, j.state_plan.batch_sharding, True)
               for j in (one, sharded)]
    tokens, seg = np.asarray(batches[0]["tokens"]), np.asarray(batches[0]["segment_ids"])
    assert (seg.max(axis=1) > 0).any()  # documents end inside rows
    assert (np.diff(seg, axis=1) <= (tokens[:, :-1] == 256)).all()  # a document ends with EOS
    loss1, grads1 = one.jit_loss_and_grads()(params, batches[0])
    loss8, grads8 = sharded.jit_loss_and_grads()(initial_state(sharded).params, batches[1])
    np.testing.assert_allclose(float(loss8), float(loss1), rtol=1e-6)
    assert_close(grads8, grads1, rtol=1e-5)


def test_a_bad_record_stops_preparation_with_one_line_and_leaves_nothing(chat_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(chat_file.read_text() + '{"prompt": "no response"}\n')
    p = subprocess.run([sys.executable, "scripts/prepare_data.py", "--format", "chat", "--input",
                        str(bad), "--out", str(tmp_path / "out"), "--no-progress"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f'error: --input {bad}:{len(CHATS) + 1}: a chat record has "messages", or "prompt" and '
        '"response"']
    assert not (tmp_path / "out").exists()  # the next run starts clean
