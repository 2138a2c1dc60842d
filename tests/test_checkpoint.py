"""Checkpoints: exact round trips, restores onto other layouts, integrity, export."""

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from tests.helpers import host, initial_state, make_job
from zero_jax.checkpoint import manager as manager_lib
from zero_jax import run
from zero_jax.data import corpus as corpus_lib
from zero_jax.checkpoint import export
from zero_jax.cli import export as export_cli
from zero_jax.checkpoint import integrity
from zero_jax.data import sampler
from zero_jax.precision import master as master_lib
from zero_jax.train import state as state_lib


def _steps(job, corpus, state, first, last):
    """Train from step `first` to `last`, one step in flight; returns losses and state."""
    step_fn = job.compile_train_step()
    t = job.run.train
    batch = functools.partial(corpus_lib.global_batch, corpus, "train", job.run.data.seq_len,
                              t.batch_size, t.seed, sharding=job.state_plan.batch_sharding)
    losses = []
    for i in range(first, last):
        state, m = step_fn(state, batch(step=i))
        losses.append(float(m["loss"]))
    return np.array(losses), state


def _save(job, state, directory, step, **cfg):
    c = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory), **cfg), job.state_plan.names,
                              writer=True)
    c.save(step, state, run.checkpoint_meta(job, step))
    c.wait()
    return c


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """fsdp=8 ZeRO-3: 10 uninterrupted steps, and a checkpoint at step 5."""
    directory = tmp_path_factory.mktemp("ckpt")
    job = make_job(corpus, mesh="fsdp=8", zero_stage=3)
    first, state5 = _steps(job, corpus, job.init_state(), 0, 5)
    _save(job, state5, directory, 5)
    saved5 = host(state5)  # before the next steps donate it
    rest, _ = _steps(job, corpus, state5, 5, 10)
    return directory, saved5, rest


@pytest.mark.parametrize("overrides", [
    dict(mesh="fsdp=8", zero_stage=3),
    dict(mesh="data=2,fsdp=4", zero_stage=1),
    dict(mesh="fsdp=4,tensor=2", layout="fsdp_tp", zero_stage=2),
    dict(mesh="pipe=2,fsdp=4", zero_stage=3, microbatches=2),
], ids=["same", "data2-fsdp4-zero1", "tensor2-fsdp4", "pipe2-fsdp4"])
def test_restore_onto_another_layout_is_exact_and_training_continues(corpus, saved, overrides):
    directory, state5, uninterrupted = saved
    job = make_job(corpus, **overrides)
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory)))
    restored, meta = checkpointer.restore(5, job.state_plan.targets)
    jax.tree.map(np.testing.assert_array_equal, host(restored), state5)  # bitwise
    assert restored.params["blocks"]["w_fc"].sharding == job.state_plan.shardings.params["blocks"]["w_fc"]
    assert meta["data"]["next_step"] == 5 and meta["run"]["parallel"]["mesh"] == "fsdp=8"
    losses, _ = _steps(job, corpus, restored, 5, 10)
    np.testing.assert_allclose(losses, uninterrupted, rtol=1e-5)


def test_pipeline_checkpoint_restores_without_a_pipeline_exactly(corpus, tmp_path):
    """The reverse of the above, with a cut that pads (6 layers on 4 stages:
    1, 2, 2, 1 in 2 slots each) and master weights (ZeRO-1, bf16): saved in
    layer order, restored whole, and back onto the stages bit for bit."""
    piped = dict(mesh="pipe=4,data=2", zero_stage=1, microbatches=4, n_layer=6, precision="bf16")
    job = make_job(corpus, **piped)
    _, state = _steps(job, corpus, job.init_state(), 0, 2)
    saved = host(job.state_plan.saved_form(state))
    _save(job, job.state_plan.saved_form(state), tmp_path, 2)
    target = make_job(corpus, mesh="fsdp=8", zero_stage=1, n_layer=6, precision="bf16")
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path)))
    restored, _ = checkpointer.restore(2, target.state_plan.targets)
    jax.tree.map(np.testing.assert_array_equal, host(restored), saved)
    assert restored.params["blocks"]["w_fc"].shape[0] == 6
    back, _ = checkpointer.restore(2, job.state_plan.targets)
    jax.tree.map(np.testing.assert_array_equal, host(job.state_plan.from_saved(back)), host(state))


def test_meta_records_config_data_position_and_prng(saved):
    directory, _, _ = saved
    meta = json.loads((directory / "5" / "meta" / "metadata").read_text())
    assert meta["data"] == {"source": "stdlib", "seed": 0, "next_step": 5, "batch_size": 16,
                            "seq_len": 32, "order": sampler.ORDER}
    assert meta["prng"]["seed"] == 0 and meta["layout"]["zero_stage"] == 3
    assert meta["model"]["n_layer"] == 4 and meta["logical_axes"]["blocks.w_fc"] == ["layers", "embed", "mlp"]
    for item in ("params", "opt_state", "scalars"):
        assert all(len(m["checksum"]) == 2 for m in meta["manifest"][item].values())


def test_parameters_only_into_a_new_optimizer(corpus, saved):
    directory, state5, _ = saved
    job = make_job(corpus, optimizer="sgd")
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory)))
    with pytest.raises(manager_lib.IncompatibleCheckpoint, match=r"opt_state\.[^:]+: in the checkpoint, not in the model"):
        checkpointer.restore(5, job.state_plan.targets)
    params, _ = checkpointer.restore(5, job.state_plan.targets, params_only=True)
    jax.tree.map(np.testing.assert_array_equal, host(params), state5.params)
    state = job.state_from_params(params)
    assert int(state.step) == 0


def test_dtype_shape_and_tree_mismatches_are_listed(corpus, saved):
    directory, _, _ = saved
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory)))
    bf16 = make_job(corpus, param_dtype="bfloat16")
    with pytest.raises(manager_lib.IncompatibleCheckpoint, match=r"params\.wte: dtype float32 saved, bfloat16 in the model"):
        checkpointer.restore(5, bf16.state_plan.targets)
    wider = make_job(corpus, vocab_multiple=384)
    with pytest.raises(manager_lib.IncompatibleCheckpoint, match=r"params\.wte: shape \(256, 192\) saved, \(384, 192\)"):
        checkpointer.restore(5, wider.state_plan.targets)


@pytest.fixture(scope="module")
def saved_master(corpus, tmp_path_factory):
    """ZeRO-1 under bf16 after 3 steps: its checkpoint and its saved form."""
    directory = tmp_path_factory.mktemp("master")
    job = make_job(corpus, zero_stage=1, precision="bf16")
    _, state = _steps(job, corpus, initial_state(job), 0, 3)
    saved = host(state_lib.saved_form(state))
    _save(job, state, directory, 3)
    return directory, saved


@pytest.mark.parametrize("target", [
    dict(zero_stage=3, precision="bf16"),
    dict(zero_stage=2, precision="bf16", mesh="data=2,fsdp=4"),
    dict(zero_stage=1, precision="fp32"),
], ids=["bf16-zero3", "bf16-zero2-data2", "fp32-zero1"])
def test_master_weights_are_what_is_saved_and_resumed(corpus, saved_master, tmp_path, target):
    """ZeRO-1 under bf16 saves its float32 master weights (no working copy):
    they resume bitwise under another stage, mesh or precision, the working
    copy is cast from them again, and a change of precision is said."""
    shutil.copytree(saved_master[0], tmp_path, dirs_exist_ok=True)
    saved = saved_master[1]
    meta = json.loads((tmp_path / "3" / "meta" / "metadata").read_text())
    assert {m["dtype"] for m in meta["manifest"]["params"].values()} == {"float32"}
    wte = export.ParamReader(tmp_path / "3").read("wte")  # the export reads the master weights
    np.testing.assert_array_equal(wte, saved.params["wte"])

    resumed = make_job(corpus, dir=str(tmp_path), resume=True, **target)
    lines = []
    checkpointer = manager_lib.Checkpointer(resumed.run.checkpoint)
    state2, step, _ = run.initial_state(resumed, checkpointer, [], lines.append)
    assert step == 3
    jax.tree.map(np.testing.assert_array_equal, host(state_lib.saved_form(state2)), saved)
    if resumed.state_plan.master:
        working = master_lib.cast_to(resumed.state_plan.working_dtypes)(saved.params)
        jax.tree.map(np.testing.assert_array_equal, host(state2.params), working)
    changed = [line for line in lines if line.startswith("precision changed")]
    assert bool(changed) == (target["precision"] != "bf16"), lines
    if changed:
        assert "compute bfloat16" in changed[0] and "compute float32" in changed[0]
    params = run.load_params(str(tmp_path), resumed)  # --init-from takes the master weights too
    # and the run names the step it loads
    assert run._init_from_label(str(tmp_path)) == f"{tmp_path / '3'} (step 3, the newest complete)"
    jax.tree.map(np.testing.assert_array_equal, host(params), saved.params)


@pytest.fixture()
def two_checkpoints(corpus, tmp_path):
    job = make_job(corpus, steps=4)
    _, s2 = _steps(job, corpus, job.init_state(), 0, 2)
    _save(job, s2, tmp_path, 2)
    saved2 = host(s2)
    _, s4 = _steps(job, corpus, s2, 2, 4)
    _save(job, s4, tmp_path, 4)
    return job, tmp_path, saved2


def _largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _fallback(job, directory):
    lines = []
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory)))
    state, _ = checkpointer.restore_latest(job.state_plan.targets, lines.append)
    return state, "\n".join(lines)


def test_flipped_byte_is_caught_and_resume_falls_back(two_checkpoints):
    job, directory, state2 = two_checkpoints
    data = _largest_data_file(directory / "4")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory)))
    # Which matrix the largest file holds depends on how its bytes compress.
    with pytest.raises(manager_lib.CorruptCheckpoint,
                       match=r"checkpoint step 4 .* checksum mismatch in params\.(blocks\.)?w"):
        checkpointer.restore(4, job.state_plan.targets)
    state, said = _fallback(job, directory)
    assert int(state.step) == 2 and "falling back to the previous complete checkpoint" in said
    jax.tree.map(np.testing.assert_array_equal, host(state), state2)


# orbax leaves futures of the failed read behind; they complain when collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_truncated_data_file_names_the_step_and_arrays(two_checkpoints):
    job, directory, _ = two_checkpoints
    data = _largest_data_file(directory / "4")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 3)
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory)))
    with pytest.raises(manager_lib.CorruptCheckpoint, match=r"checkpoint step 4 .*cannot read params\.blocks\.w_"):
        checkpointer.restore(4, job.state_plan.targets)
    state, said = _fallback(job, directory)
    assert int(state.step) == 2 and "step 4" in said


def test_missing_commit_marker_means_incomplete(two_checkpoints):
    job, directory, _ = two_checkpoints
    (directory / "4" / manager_lib.COMMIT_MARKER).unlink()
    checkpointer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(directory)))
    assert checkpointer.complete_steps() == [2]
    state, said = _fallback(job, directory)
    assert int(state.step) == 2 and "never committed" in said


def test_retention_keeps_the_last_k_and_every_mth(corpus, tmp_path):
    job = make_job(corpus)
    state = job.init_state()
    said = []
    c = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path), keep_last=2, keep_every=4),
                              job.state_plan.names, writer=True, log=said.append)
    for step in range(1, 9):
        c.save(step, state, run.checkpoint_meta(job, step))
    c.wait()
    assert c.complete_steps() == [4, 7, 8]
    # One line per committed save, as it commits.
    assert [line.split()[2] for line in said] == [str(s) for s in range(1, 9)], said
    assert re.fullmatch(rf"checkpoint step 8 saved in {re.escape(str(tmp_path))}/8 \([\d.]+ MiB, committed "
                        r"[\d.]+ s after the save began\)", said[-1]), said[-1]


def test_export_streams_the_gathered_parameters_and_imports_back(corpus, saved, tmp_path):
    directory, state5, _ = saved
    out = tmp_path / "model.safetensors"
    p = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint-dir", str(directory),
                        "--out", str(out)], cwd=Path(__file__).parent.parent, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"wrote {out}: 56 tensors (float32), ") and \
        p.stdout.rstrip().endswith(f"bytes, from checkpoint step 5 of {directory}"), p.stdout
    params = state5.params
    with safe_open(str(out), framework="numpy") as f:
        assert len(list(f.keys())) == 4 * 13 + 4  # 13 stacked arrays per layer, 4 unstacked
        for i in range(4):
            np.testing.assert_array_equal(f.get_tensor(f"blocks.{i}.w_fc"), params["blocks"]["w_fc"][i])
        np.testing.assert_array_equal(f.get_tensor("wte"), params["wte"])
    job = make_job(corpus, mesh="fsdp=4,tensor=2", layout="fsdp_tp")
    imported = run.load_params(str(out), job)
    jax.tree.map(np.testing.assert_array_equal, host(imported), params)


def _bits(x) -> np.ndarray:
    """bf16 values as their 16 bits, so that equality is bit for bit (NaNs too)."""
    return np.asarray(x, ml_dtypes.bfloat16).view(np.uint16)


def _header_dtypes(path) -> set[str]:
    return {entry["dtype"] for entry in export.SafetensorsFile(path).header.values()}


def _narrowed_export(corpus, directory, tmp_path, capsys, dtype: str, code: str):
    """`--out` of the float32 checkpoint in `directory` in `dtype`: the file
    says `code` for every tensor and the export says it narrowed, in one
    line. Returns the file and its values (numpy, in `dtype`)."""
    out = tmp_path / "model.safetensors"
    assert export_cli.main(["--checkpoint-dir", str(directory), "--out", str(out),
                            "--dtype", dtype]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"wrote {out}: 56 tensors ({dtype}), "), lines
    assert lines[1] == (f"--out: parameters stored in float32 written in {dtype} (as --dtype "
                        "asked); --dtype float32 keeps every bit"), lines
    assert _header_dtypes(out) == {code}
    return out, export.read_consolidated(out, make_job(corpus).state_plan.names)


def test_export_in_bfloat16_imports_back_bit_for_bit(corpus, saved, tmp_path, capsys):
    """--dtype bfloat16 on a float32 run: BF16 in the file's header, each
    value the float32 one rounded to nearest even, and said in one line.
    Imported, the file's values are what is placed, cast per the policy:
    bit for bit into bfloat16 parameters, exactly widened into float32."""
    out, in_file = _narrowed_export(corpus, saved[0], tmp_path, capsys, "bfloat16", "BF16")
    state5 = saved[1]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(
        _bits(a), _bits(jnp.asarray(b).astype("bfloat16"))), in_file, state5.params)
    for dtype in ("bfloat16", "float32"):
        job = make_job(corpus, mesh="fsdp=4,tensor=2", layout="fsdp_tp", param_dtype=dtype)
        imported = run.load_params(str(out), job)
        assert {x.dtype for x in jax.tree.leaves(imported)} == {jnp.dtype(dtype)}
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b, dtype)), host(imported), in_file)
        assert imported["blocks"]["w_fc"].sharding == job.state_plan.shardings.params["blocks"]["w_fc"]


def test_export_in_float16_rounds_each_value_and_imports_back(corpus, saved, tmp_path, capsys):
    """--dtype float16 on a float32 run: F16 in the header, each value the
    float32 one rounded, said as a narrowing; imported into float32
    parameters, exactly those values widened."""
    out, in_file = _narrowed_export(corpus, saved[0], tmp_path, capsys, "float16", "F16")
    state5 = saved[1]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b).astype(np.float16)),
                 in_file, state5.params)
    imported = run.load_params(str(out), make_job(corpus, mesh="fsdp=4,tensor=2", layout="fsdp_tp"))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a),
                                                            np.asarray(b, np.float32)),
                 host(imported), in_file)


def test_export_refuses_a_value_float16_cannot_hold(corpus, tmp_path, capsys):
    """A parameter above float16's 65504 would be written as infinity: the
    export names it and leaves no weights behind, for --out and for --hf-dir;
    bfloat16, float32's range, writes it."""
    job = make_job(corpus)
    state = job.init_state()
    wte = state.params["wte"]
    big = jax.device_put(wte.at[3, 5].set(1.0e5), wte.sharding)
    _save(job, state._replace(params={**state.params, "wte": big}), tmp_path / "ckpt", 1)
    for target in (["--out", str(tmp_path / "m.safetensors")], ["--hf-dir", str(tmp_path / "hf")]):
        assert export_cli.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--dtype", "float16",
                                *target]) == 2
        err = capsys.readouterr().err
        name = "wte" if target[0] == "--out" else "wte.weight"  # the name in the file written
        assert err.startswith(f"error: {name}: values up to 1e+05 do not fit in float16, whose "
                              "largest is 6.55e+04; export in float32"), err
        assert err.rstrip().endswith("; nothing written"), err
    assert not (tmp_path / "m.safetensors").exists()
    assert not list((tmp_path / "hf").glob("*.safetensors")), list((tmp_path / "hf").iterdir())
    assert export_cli.main(["--checkpoint-dir", str(tmp_path / "ckpt"), "--dtype", "bfloat16",
                            "--out", str(tmp_path / "m.safetensors")]) == 0
    assert export.SafetensorsFile(tmp_path / "m.safetensors").get("wte")[3, 5] == \
        ml_dtypes.bfloat16(1.0e5)


@pytest.fixture(scope="module")
def saved_bf16(corpus, tmp_path_factory):
    """A checkpoint of a run that stores bfloat16 parameters (no master copy)."""
    directory = tmp_path_factory.mktemp("bf16")
    job = make_job(corpus, precision="bf16", param_dtype="bfloat16", opt_state_dtype="float32")
    _save(job, initial_state(job), directory, 0)
    return directory


@pytest.mark.parametrize("run_kind,out,hf_dir", [
    ("fp32", "F32", "float32"),
    ("bf16-params", "BF16", "bfloat16"),
    ("bf16-float32-masters", "F32", "bfloat16"),
])
def test_export_dtype_defaults_to_what_the_run_trained(saved, saved_bf16, saved_master,
                                                       tmp_path, capsys, run_kind, out, hf_dir):
    """No --dtype: an fp32 run exports float32; a run storing bfloat16
    parameters exports bfloat16; a bf16 run over float32 master weights
    exports its masters whole (--out) and bfloat16 for Hugging Face, whose
    config.json says so (torch_dtype) and which the output says."""
    directory = {"fp32": saved[0], "bf16-params": saved_bf16,
                 "bf16-float32-masters": saved_master[0]}[run_kind]
    assert export_cli.main(["--checkpoint-dir", str(directory), "--out", str(tmp_path / "m.safetensors"),
                            "--hf-dir", str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out
    assert _header_dtypes(tmp_path / "m.safetensors") == {out}
    assert _header_dtypes(tmp_path / "hf" / "model.safetensors") == {"BF16" if hf_dir == "bfloat16" else "F32"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == hf_dir
    narrowed = [line for line in said.splitlines() if "written in bfloat16" in line]
    assert narrowed == (["--hf-dir: parameters stored in float32 written in bfloat16 (the dtype "
                         "the run computed in); --dtype float32 keeps every bit"]
                        if run_kind == "bf16-float32-masters" else []), said


def test_export_refuses_corrupt_data(corpus, two_checkpoints, tmp_path):
    _, directory, _ = two_checkpoints
    data = _largest_data_file(directory / "4")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    out = tmp_path / "m.safetensors"
    p = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint-dir", str(directory),
                        "--out", str(out)], cwd=Path(__file__).parent.parent, capture_output=True, text=True)
    assert p.returncode == 4 and "checksum mismatch" in p.stderr and not out.exists()


def test_running_checksum_matches_the_device_one():
    x = jax.random.normal(jax.random.key(0), (3, 40, 7)).astype("bfloat16")
    running = integrity.RunningChecksum()
    for i in range(3):
        running.add(np.asarray(x[i]), i * 40 * 7)
    assert running.value == integrity.checksums({"x": x})["x"]
