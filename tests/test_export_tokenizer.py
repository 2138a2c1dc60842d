"""The tokenizer a Hugging Face export carries (zero_jax/checkpoint/tokenizer_files.py):
the files the run's data was prepared with, the same bytes, and the line
saying so; a changed tokenizer refused; byte-level data's note; a file
already in --hf-dir never replaced unasked. tests/interop/test_tokenizer_export.py
loads the export in transformers."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import initial_state, make_job
from zero_jax import run
from zero_jax.checkpoint import manager as manager_lib
from zero_jax.cli import export as export_cli
from zero_jax.cli import prepare_data
from zero_jax.data import corpus as corpus_lib
from zero_jax.data import train_tokenizer

FAST = "PreTrainedTokenizerFast"


def make_tokenizer(out: Path) -> Path:
    """A small byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json)."""
    train_tokenizer.write(out, vocab_size=300, sample_bytes=50_000)
    return out


def prepared(tmp: Path, tokenizer: str = "bytes") -> Path:
    """Four short documents prepared with `tokenizer`."""
    (tmp / "texts").mkdir()
    for i in range(4):
        (tmp / "texts" / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    out = tmp / "data"
    assert prepare_data.main(["--input", f"{tmp}/texts/*.txt", "--out", str(out), "--tokenizer",
                              tokenizer, "--val-fraction", "0.5", "--workers", "1",
                              "--no-progress"]) == 0
    return out


def checkpoint(tmp: Path, source: str, corpus=None, **overrides) -> Path:
    """gpt-tiny's initial state, saved as a run on `source` saves it (data and tokenizer
    recorded)."""
    corpus = corpus or corpus_lib.load(source)
    job = make_job(corpus, data=source, **overrides)
    c = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp / "ckpt")), job.state_plan.names,
                              writer=True)
    c.save(0, initial_state(job), run.checkpoint_meta(job, 0, corpus))
    c.wait()
    return tmp / "ckpt"


def export(ckpt: Path, hf: Path, *flags: str) -> int:
    return export_cli.main(["--checkpoint-dir", str(ckpt), "--hf-dir", str(hf), *flags])


def said(capsys) -> str:
    """The one line the export printed about the tokenizer."""
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tokenizer:")]
    assert len(lines) == 1, lines
    return lines[0]


def same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """(tokenizer directory, checkpoint) of a run on data prepared with a BPE tokenizer."""
    tmp = tmp_path_factory.mktemp("bpe")
    tok = make_tokenizer(tmp / "tok")
    return tok, checkpoint(tmp, str(prepared(tmp, str(tok))))


def test_hf_export_copies_the_tokenizer_the_data_was_prepared_with(bpe_run, tmp_path, capsys):
    tok, ckpt = bpe_run
    assert export(ckpt, tmp_path / "hf") == 0
    assert said(capsys) == (f"tokenizer: copied tokenizer.json, tokenizer_config.json from {tok} "
                    f"(SHA-256 {sha(tok / 'tokenizer.json')[:12]}..., the data's); gave "
                    f"tokenizer_config.json tokenizer_class {FAST} (it had none)")
    assert same_bytes(tmp_path / "hf" / "tokenizer.json", tok / "tokenizer.json")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config == {"tokenizer_class": FAST,
                      **json.loads((tok / "tokenizer_config.json").read_text())}
    # generate stops on the data's end of document, not on GPT-2's 50256
    model = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (model["eos_token_id"], model["bos_token_id"]) == (0, 0)
    assert export(ckpt, tmp_path / "hf", "--overwrite") == 0  # the same files again


def test_tokenizer_flag_copies_a_bare_tokenizer_json_with_a_config_made_for_it(
        bpe_run, tmp_path, capsys):
    tok, ckpt = bpe_run
    (tmp_path / "bare").mkdir()
    shutil.copy(tok / "tokenizer.json", tmp_path / "bare")
    bare = tmp_path / "bare" / "tokenizer.json"
    assert export(ckpt, tmp_path / "hf", "--tokenizer", str(bare)) == 0
    assert said(capsys) == (
        f"tokenizer: copied tokenizer.json from {tmp_path / 'bare'} (SHA-256 "
        f"{sha(tok / 'tokenizer.json')[:12]}..., as --tokenizer asked); wrote "
        f"tokenizer_config.json ({FAST}, eos_token <|endoftext|>)")
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": FAST, "eos_token": "<|endoftext|>"}  # id 0, the data's eos_id


def test_a_changed_tokenizer_is_refused_and_a_removed_one_said(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok")
    ckpt = checkpoint(tmp_path, str(prepared(tmp_path, str(tok))))
    shutil.copytree(tok, tmp_path / "original")
    was = sha(tok / "tokenizer.json")
    with open(tok / "tokenizer.json", "a") as f:
        f.write("\n")
    assert export(ckpt, tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert was in err and sha(tok / "tokenizer.json") in err and "--tokenizer DIR" in err, err
    assert not (tmp_path / "hf").exists()  # refused before anything is written
    assert export(ckpt, tmp_path / "hf", "--tokenizer", str(tmp_path / "original")) == 0
    assert sha(tmp_path / "hf" / "tokenizer.json") == was
    said(capsys)
    shutil.rmtree(tok)
    assert export(ckpt, tmp_path / "hf2") == 0
    assert said(capsys) == (
        f"tokenizer: none exported (the data's tokenizer {tok / 'tokenizer.json'} is no longer "
        "there); add one with --tokenizer DIR (a directory holding tokenizer.json, or the file)")
    assert not (tmp_path / "hf2" / "tokenizer.json").exists()


@pytest.mark.parametrize("data", ["prepared", "stdlib"])
def test_byte_level_data_exports_a_note_that_the_model_reads_bytes(data, corpus, tmp_path, capsys):
    ckpt = (checkpoint(tmp_path, str(prepared(tmp_path))) if data == "prepared"
            else checkpoint(tmp_path, "stdlib", corpus))
    assert export(ckpt, tmp_path / "hf") == 0
    out = capsys.readouterr().out
    end = "end of document 256" if data == "prepared" else "no end-of-document id"
    assert [x for x in out.splitlines() if x.startswith("tokenizer:")] == [
        f"tokenizer: none, the model reads UTF-8 bytes (ids 0-255, {end}); wrote TOKENIZER.md "
        "saying so"]
    note = (tmp_path / "hf" / "TOKENIZER.md").read_text()
    assert "This model reads UTF-8 bytes: the ids 0-255 are the bytes of the text" in note
    assert ("256 is the end-of-document id" in note) == (data == "prepared"), note
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "TOKENIZER.md", "config.json", *(["generation_config.json"] if data == "prepared" else []),
        "model.safetensors"]
    model = json.loads((tmp_path / "hf" / "config.json").read_text())
    eos = 256 if data == "prepared" else None  # none: no architecture default stands in
    assert (model["eos_token_id"], model["bos_token_id"]) == (eos, eos)
    (line,) = [x for x in out.splitlines() if x.startswith("token ids:")]
    if data == "prepared":
        assert generation(tmp_path / "hf") == {"bos_token_id": 256, "eos_token_id": 256}
        assert line == ("token ids: bos_token_id 256, eos_token_id 256 in config.json and "
                        "generation_config.json: the byte-level data's end of document; bos is "
                        "eos, as GPT-2 begins text with its end-of-text token")
    else:
        assert line == ("token ids: none known (null in config.json, no "
                        "generation_config.json): the data, stdlib, had no end-of-document id")


def test_without_a_data_tokenizer_the_init_from_directory_s_is_copied(bpe_run, tmp_path, capsys):
    """A flat token file names no tokenizer: that of the Hugging Face
    directory the run started from (--init-from) is taken."""
    tok, ckpt = bpe_run
    assert export(ckpt, tmp_path / "start") == 0
    np.random.default_rng(0).integers(0, 300, 4096, dtype=np.uint16).tofile(tmp_path / "t.bin")
    (tmp_path / "t.bin.json").write_text('{"vocab_size": 300}')
    flat = checkpoint(tmp_path, str(tmp_path / "t.bin"), init_from=str(tmp_path / "start"))
    said(capsys)
    assert export(flat, tmp_path / "hf") == 0
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if x.startswith("tokenizer:")] == [
        f"tokenizer: copied tokenizer.json, tokenizer_config.json from {tmp_path / 'start'} "
        f"(SHA-256 {sha(tok / 'tokenizer.json')[:12]}..., of the weights' directory)"]
    assert same_bytes(tmp_path / "hf" / "tokenizer.json", tok / "tokenizer.json")
    # the flat file says no end of document: the ids are the weights' directory's
    model = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (model["eos_token_id"], model["bos_token_id"]) == (0, 0)
    assert generation(tmp_path / "hf") == generation(tmp_path / "start")
    start = tmp_path / "start"
    assert [x for x in out if x.startswith("token ids:")] == [
        f"token ids: bos_token_id 0, eos_token_id 0 in config.json, generation_config.json as "
        f"{start}'s: those of {start}, whose tokenizer this is; the data ({tmp_path / 't.bin'}) "
        "names no tokenizer to confirm them"]


def test_an_export_never_replaces_another_tokenizer_file(bpe_run, tmp_path, capsys):
    _, ckpt = bpe_run
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert export(ckpt, tmp_path / "hf") == 2
    assert capsys.readouterr().err == (
        f"error: --hf-dir {tmp_path / 'hf'}: already holds tokenizer.json; give --overwrite to "
        "replace the directory, or export into another\n")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["tokenizer.json"]
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == "{}"


def test_tokenizer_without_hf_dir_is_refused(bpe_run, tmp_path, capsys):
    tok, ckpt = bpe_run
    assert export_cli.main(["--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "m.safetensors"),
                            "--tokenizer", str(tok)]) == 2
    assert "--tokenizer" in capsys.readouterr().err and not (tmp_path / "m.safetensors").exists()


# -- the special tokens' ids: config.json and generation_config.json --------

def ids_line(capsys) -> str:
    """The one line the export printed about the token ids."""
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("token ids:")]
    assert len(lines) == 1, lines
    return lines[0]


def special(hf: Path) -> tuple:
    model = json.loads((hf / "config.json").read_text())
    return tuple(model.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id"))


def generation(hf: Path) -> dict | None:
    path = hf / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else None


# What a Hugging Face model directory says of its own special tokens (bos 1,
# as Mixtral's; eos 0, the tokenizer's <|endoftext|>; generate's settings).
MODEL_IDS = {"bos_token_id": 1, "eos_token_id": 0}
MODEL_GENERATION = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": [0, 2],
                    "pad_token_id": 2, "max_new_tokens": 64, "transformers_version": "4.46.0"}


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """(model directory, checkpoints) of a Mixtral-family model fine-tuned
    from a Hugging Face directory (--model hf:DIR --init-from DIR): on data
    prepared with that directory ("own"), and on data prepared with a copy
    of its tokenizer alone, the same bytes, beside no config.json ("copy")."""
    tmp = tmp_path_factory.mktemp("mixtral")
    tok = make_tokenizer(tmp / "tok")
    for d in ("a", "b", "c"):
        (tmp / d).mkdir()
    first = checkpoint(tmp / "a", str(prepared(tmp / "a", str(tok))), model="moe-tiny")
    base = tmp / "base"
    assert export(first, base) == 0
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, **MODEL_IDS}))
    (base / "generation_config.json").write_text(json.dumps(MODEL_GENERATION))
    assert same_bytes(base / "tokenizer.json", tok / "tokenizer.json")
    hf = {"model": f"hf:{base}", "init_from": str(base)}
    return base, {"own": checkpoint(tmp / "b", str(prepared(tmp / "b", str(base))), **hf),
                  "copy": checkpoint(tmp / "c", str(tmp / "a" / "data"), **hf)}


@pytest.mark.parametrize("data", ["own", "copy"])
def test_a_fine_tune_on_the_model_s_tokenizer_keeps_its_ids_and_generation_config(
        fine_tuned, data, tmp_path, capsys):
    """The model's own bos, eos and pad, in config.json as its config.json
    says them and in generation_config.json as its generation_config.json
    does (the writer's bookkeeping left out): generate begins and stops as
    the model did. Found from the weights' directory whether the data was
    prepared with it or with the same tokenizer.json elsewhere."""
    base, checkpoints = fine_tuned
    capsys.readouterr()
    assert export(checkpoints[data], tmp_path / "hf") == 0
    assert special(tmp_path / "hf") == (1, 0, None)
    assert generation(tmp_path / "hf") == {"bos_token_id": 1, "eos_token_id": [0, 2],
                                           "pad_token_id": 2, "max_new_tokens": 64}
    assert ids_line(capsys) == (
        f"token ids: bos_token_id 1, eos_token_id 0 in config.json, generation_config.json "
        f"as {base}'s: the model's own, whose tokenizer the data was prepared with")


def test_the_data_s_end_of_document_is_added_where_the_model_s_eos_differs(
        fine_tuned, tmp_path, capsys):
    base, checkpoints = fine_tuned
    model = tmp_path / "model"
    shutil.copytree(base, model)
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                              "eos_token_id": 2}))
    (model / "config.json").write_text(json.dumps({
        **json.loads((base / "config.json").read_text()), "eos_token_id": 2}))
    tok = json.loads((model / "tokenizer_config.json").read_text())
    ckpt = checkpoint(tmp_path, str(prepared(tmp_path, str(model))), model=f"hf:{model}",
                      init_from=str(model))
    capsys.readouterr()
    assert tok["eos_token"] == "<|endoftext|>"  # id 0, the data's end of document
    assert export(ckpt, tmp_path / "hf") == 0
    assert special(tmp_path / "hf") == (1, 2, None)
    assert generation(tmp_path / "hf") == {"bos_token_id": 1, "eos_token_id": [2, 0]}
    assert ids_line(capsys).endswith(
        "; the data's end of document, 0, is not among the model's: added to "
        "generation_config.json's eos_token_id")


def test_without_a_model_s_ids_the_export_says_which_it_wrote_and_why(bpe_run, tmp_path, capsys):
    """A tokenizer beside no model's config.json: the data's end of document,
    GPT-2's bos the same, in config.json and generation_config.json, said."""
    tok, ckpt = bpe_run
    assert export(ckpt, tmp_path / "hf") == 0
    assert special(tmp_path / "hf") == (0, 0, None)
    assert generation(tmp_path / "hf") == {"bos_token_id": 0, "eos_token_id": 0}
    assert ids_line(capsys) == (
        "token ids: bos_token_id 0, eos_token_id 0 in config.json and generation_config.json: "
        f"the data's end of document (its tokenizer's directory {tok} holds no model's "
        "config.json to take a model's ids from); bos is eos, as GPT-2 begins text with its "
        "end-of-text token")
