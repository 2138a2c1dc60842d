"""An export never deletes or replaces what the user had (zero_jax/cli/export.py):
an existing --out or a non-empty --hf-dir is refused, before anything is
read, unless --overwrite is given; every file is written under a temporary
name beside its destination and renamed into place only once all are
written, so a refusal half-way (a value float16 cannot hold) leaves the
previous export byte for byte, and --overwrite swaps a whole directory in
by renames, never leaving a half-written one under the user's name."""

from pathlib import Path

import jax
import pytest

from tests.helpers import make_job
from zero_jax import run
from zero_jax.checkpoint import manager as manager_lib
from zero_jax.cli import export as export_cli


def _save(job, state, directory: Path) -> Path:
    c = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory)), job.state_plan.names,
                              writer=True)
    c.save(1, state, run.checkpoint_meta(job, 1))
    c.wait()
    return directory


@pytest.fixture(scope="module")
def checkpoints(corpus, tmp_path_factory):
    """(plain, big): gpt-tiny's initial state, and the same with one value
    float16 cannot hold (1e5 > 65504)."""
    tmp = tmp_path_factory.mktemp("ckpts")
    job = make_job(corpus)
    state = job.init_state()
    wte = state.params["wte"]
    big = jax.device_put(wte.at[3, 5].set(1.0e5), wte.sharding)
    return (_save(job, state, tmp / "plain"),
            _save(job, state._replace(params={**state.params, "wte": big}), tmp / "big"))


def export(ckpt: Path, *flags: str) -> int:
    return export_cli.main(["--checkpoint-dir", str(ckpt), *flags])


def contents(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` by relative name, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def previous_out(plain: Path, tmp_path: Path, capsys) -> tuple[Path, bytes]:
    """A good export already at --out, and its bytes."""
    out = tmp_path / "m.safetensors"
    assert export(plain, "--out", str(out)) == 0
    capsys.readouterr()
    return out, out.read_bytes()


def test_an_existing_out_is_refused_and_left_as_it_was(checkpoints, tmp_path, capsys):
    plain, big = checkpoints
    out, before = previous_out(plain, tmp_path, capsys)
    for flags in ([], ["--dtype", "float16"]):  # the float16 refusal used to delete it first
        assert export(big, "--out", str(out), *flags) == 2
        assert error_line(capsys) == (
            f"error: --out {out}: already exists; give --overwrite to replace it, or another "
            "file name")
        assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_a_float16_refusal_under_overwrite_leaves_the_previous_out(checkpoints, tmp_path, capsys):
    plain, big = checkpoints
    out, before = previous_out(plain, tmp_path, capsys)
    assert export(big, "--out", str(out), "--dtype", "float16", "--overwrite") == 2
    line = error_line(capsys)
    assert line.startswith("error: wte: values up to 1e+05 do not fit in float16"), line
    assert line.endswith(f"; nothing written, {out} left as it was"), line
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no temporary left


def test_overwrite_replaces_an_out_whole(checkpoints, tmp_path, capsys):
    plain, big = checkpoints
    out, fresh = tmp_path / "m.safetensors", tmp_path / "fresh.safetensors"
    assert export(plain, "--out", str(out)) == 0
    assert export(big, "--out", str(fresh)) == 0
    assert out.read_bytes() != fresh.read_bytes()
    assert export(big, "--out", str(out), "--overwrite") == 0
    assert out.read_bytes() == fresh.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.safetensors", "m.safetensors"]


def test_a_non_empty_hf_dir_is_refused_and_left_as_it_was(checkpoints, tmp_path, capsys):
    plain, big = checkpoints
    hf = tmp_path / "hf"
    assert export(plain, "--hf-dir", str(hf)) == 0
    (hf / "README.md").write_text("my notes\n")
    before = contents(hf)
    capsys.readouterr()
    for flags in ([], ["--dtype", "float16"]):
        assert export(big, "--hf-dir", str(hf), *flags) == 2
        assert error_line(capsys) == (
            f"error: --hf-dir {hf}: already holds README.md, TOKENIZER.md, config.json and 1 "
            "more; give --overwrite to replace the directory, or export into another")
        assert contents(hf) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_a_float16_refusal_under_overwrite_leaves_the_previous_hf_dir(checkpoints, tmp_path,
                                                                      capsys):
    """--out and --hf-dir together: neither is touched when the second fails."""
    plain, big = checkpoints
    hf, out = tmp_path / "hf", tmp_path / "m.safetensors"
    assert export(plain, "--hf-dir", str(hf), "--out", str(out)) == 0
    before, before_out = contents(hf), out.read_bytes()
    capsys.readouterr()
    assert export(big, "--out", str(out), "--hf-dir", str(hf), "--dtype", "float16",
                  "--overwrite") == 2
    line = error_line(capsys)
    assert line.startswith("error: wte: values up to 1e+05 do not fit in float16"), line
    assert contents(hf) == before and out.read_bytes() == before_out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.safetensors"]


def test_overwrite_swaps_the_hf_dir_whole(checkpoints, tmp_path, capsys):
    plain, big = checkpoints
    hf, fresh = tmp_path / "hf", tmp_path / "fresh"
    assert export(plain, "--hf-dir", str(hf)) == 0
    (hf / "README.md").write_text("my notes\n")
    assert export(big, "--hf-dir", str(fresh)) == 0
    assert export(big, "--hf-dir", str(hf), "--overwrite") == 0
    assert contents(hf) == contents(fresh)  # the notes went with the directory replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "hf"]


def test_an_empty_hf_dir_or_a_new_one_is_written_without_overwrite(checkpoints, tmp_path):
    plain, _ = checkpoints
    (tmp_path / "empty").mkdir()
    assert export(plain, "--hf-dir", str(tmp_path / "empty")) == 0
    assert export(plain, "--hf-dir", str(tmp_path / "new" / "hf")) == 0
    assert contents(tmp_path / "empty") == contents(tmp_path / "new" / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]


def test_overwrite_through_a_link_replaces_what_it_points_to(checkpoints, tmp_path):
    """A --hf-dir that is a symbolic link stays one: the directory it names is swapped."""
    plain, big = checkpoints
    assert export(plain, "--hf-dir", str(tmp_path / "real")) == 0
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert export(big, "--hf-dir", str(tmp_path / "fresh")) == 0
    assert export(big, "--hf-dir", str(tmp_path / "link"), "--overwrite") == 0
    assert (tmp_path / "link").is_symlink() and contents(tmp_path / "real") == contents(
        tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "link", "real"]


def test_an_out_inside_the_hf_dir_is_refused(checkpoints, tmp_path, capsys):
    """The directory is written whole, so a file inside it would be lost."""
    plain, _ = checkpoints
    (tmp_path / "hf").mkdir()
    assert export(plain, "--hf-dir", str(tmp_path / "hf"), "--out",
                  str(tmp_path / "hf" / "m.safetensors")) == 2
    assert "inside --hf-dir" in error_line(capsys)
    assert list((tmp_path / "hf").iterdir()) == []


def test_a_model_its_architecture_cannot_express_is_one_line(corpus, tmp_path, capsys):
    """A Llama with a sliding window: LlamaForCausalLM has none (transformers
    would attend to every position), so --hf-dir is refused in one line
    before anything is written, and a .safetensors --out alone still works."""
    job = make_job(corpus, model="llama-tiny", sliding_window=16)
    ckpt = _save(job, job.init_state(), tmp_path / "ckpt")
    hf = tmp_path / "hf"
    capsys.readouterr()
    assert export(ckpt, "--hf-dir", str(hf)) == 2
    assert error_line(capsys).startswith(
        "error: sliding_window = 16 cannot be exported: LlamaForCausalLM has no sliding window")
    assert not hf.exists()
    assert export(ckpt, "--out", str(tmp_path / "m.safetensors")) == 0
