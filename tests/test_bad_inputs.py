"""Every user error of every command: exit status 2 and one line on stderr,
`error: ...`, naming the parameter or value at fault; never a traceback.

Each command's `main(argv)` (zero_jax/cli/<name>.py, what `zero-jax NAME`
and scripts/<name>.py run) runs in this process (8 simulated CPU devices,
conftest.py), and every case fails before anything is compiled or spawned.
"""

from __future__ import annotations

import importlib
import json
import socket
import struct
from pathlib import Path

import numpy as np
import pytest

from zero_jax.cli import main as cli


def script(name: str):
    """The command behind scripts/<name>.py: zero_jax/cli/<name>.py."""
    return importlib.import_module(f"zero_jax.cli.{name}")


# -- what each case finds in its directory ({d} in its arguments) ----------

def tokens(d: Path, n: int = 20_000) -> None:
    """A flat uint16 token file with its vocabulary sidecar: enough for a run."""
    np.random.default_rng(0).integers(0, 256, n, dtype=np.uint16).tofile(d / "tokens.bin")
    (d / "tokens.bin.json").write_text('{"vocab_size": 256}')


def tiny_tokens(d: Path) -> None:
    tokens(d, 50)


def write(name: str, text: str):
    def setup(d: Path) -> None:
        tokens(d)
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return setup


def mkdir(*names: str):
    def setup(d: Path) -> None:
        for name in names:
            (d / name).mkdir(parents=True)
    return setup


def checkpoint_steps(*steps: int, meta: bool = True, model: dict | None = None):
    """A checkpoint directory whose steps are committed (no arrays: every
    case here fails before reading one), recording `model` (default: a
    name only)."""
    def setup(d: Path) -> None:
        for step in steps:
            (d / "ckpt" / str(step) / "meta").mkdir(parents=True)
            (d / "ckpt" / str(step) / "commit_success.txt").write_text("ok")
            if meta:
                (d / "ckpt" / str(step) / "meta" / "metadata").write_text(json.dumps(
                    {"manifest": {"params": {}}, "model": model or {"name": "gpt-tiny"}}))
    return setup


# gpt-tiny's shape as a checkpoint records it (zero_jax/run.py checkpoint_meta)
GPT_TINY = {"name": "gpt-tiny", "vocab_size": 256, "n_layer": 2, "n_head": 2, "d_model": 64,
            "d_mlp": 256, "max_seq_len": 64}


def text_input(d: Path) -> None:
    (d / "in.txt").write_text("a document\n")


def text_input_and_out(d: Path) -> None:
    text_input(d)
    (d / "out").mkdir()
    (d / "out" / "meta.json").write_text("{}")


def text_input_and_flat_out(d: Path) -> None:
    text_input(d)
    (d / "tokens.bin").write_bytes(b"\0\0")


def text_input_and_bad_tokenizer(d: Path) -> None:
    text_input(d)
    (d / "tokenizer.json").write_text('{"not": "a tokenizer"}')


def hf_model_and_larger_data(d: Path) -> None:
    """A Hugging Face Llama of vocabulary 512 (its config.json; the weights
    file is not read before compiling) and data whose vocabulary is 8192."""
    tokens(d)
    (d / "tokens.bin.json").write_text('{"vocab_size": 8192}')
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
        "vocab_size": 512, "max_position_embeddings": 128}))
    (d / "hf" / "model.safetensors").write_bytes(b"")


def bad_header(d: Path, name: str = "m.safetensors") -> None:
    """A safetensors file whose 16-byte header is not JSON."""
    tokens(d)
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(struct.pack("<Q", 16) + b'{"a": not json!}' + bytes(64))


def hf_model_with_bad_header(d: Path) -> None:
    hf_model_and_larger_data(d)
    (d / "tokens.bin.json").write_text('{"vocab_size": 256}')
    bad_header(d, "hf/model.safetensors")


TRAIN = ["--data", "{d}/tokens.bin"]  # a run's data, read in milliseconds

# (id, script, setup or None, argv, a substring of the message naming the
# parameter or value). A case in USAGE is argparse's own error: its usage
# lines, then the error line, exit 2.
CASES = [
    # scripts/train.py: the run config
    ("train-toml-syntax", "train", write("run.toml", "[train\nsteps = 3\n"),
     [*TRAIN, "--config", "{d}/run.toml"], "not valid TOML"),
    ("train-toml-unknown-key", "train", write("run.toml", "[train]\nstepz = 3\n"),
     [*TRAIN, "--config", "{d}/run.toml"], "stepz"),
    ("train-toml-unknown-table", "train", write("run.toml", "[trian]\nsteps = 3\n"),
     [*TRAIN, "--config", "{d}/run.toml"], "trian"),
    ("train-toml-wrong-type", "train", write("run.toml", '[train]\nsteps = "ten"\n'),
     [*TRAIN, "--config", "{d}/run.toml"], "steps"),
    ("train-config-missing", "train", tokens, [*TRAIN, "--config", "{d}/nope.toml"], "nope.toml"),
    ("train-config-is-a-directory", "train", tokens, [*TRAIN, "--config", "{d}"], "--config"),
    ("train-lr-nan", "train", tokens, [*TRAIN, "--lr", "nan"], "--lr nan"),
    ("train-lr-negative", "train", tokens, [*TRAIN, "--lr", "-1"], "--lr -1"),
    ("train-b2-above-one", "train", tokens, [*TRAIN, "--b2", "1.5"], "--b2 1.5"),
    ("train-weight-decay-negative", "train", tokens, [*TRAIN, "--weight-decay", "-0.1"],
     "--weight-decay -0.1"),
    ("train-clip-norm-negative", "train", tokens, [*TRAIN, "--clip-norm", "-1"], "--clip-norm -1"),
    ("train-min-loss-scale-nan", "train", tokens, [*TRAIN, "--min-loss-scale", "nan"],
     "--min-loss-scale nan"),
    ("train-steps-zero", "train", tokens, [*TRAIN, "--steps", "0"], "--steps 0"),
    ("train-batch-size-zero", "train", tokens, [*TRAIN, "--batch-size", "0"], "--batch-size 0"),
    ("train-checkpoint-every-negative", "train", tokens,
     [*TRAIN, "--checkpoint-dir", "{d}/ckpt", "--checkpoint-every", "-1"], "--checkpoint-every -1"),
    ("train-unknown-optimizer", "train", tokens, [*TRAIN, "--optimizer", "adam"],
     "--optimizer 'adam'"),
    ("train-unknown-model", "train", tokens, [*TRAIN, "--model", "gpt-huge"], "--model 'gpt-huge'"),
    ("train-unknown-precision", "train", tokens, [*TRAIN, "--precision", "fp4"],
     "--precision 'fp4'"),
    ("train-unknown-remat", "train", tokens, [*TRAIN, "--remat", "some"], "--remat 'some'"),
    ("train-zero-stage-4", "train", tokens, [*TRAIN, "--zero-stage", "4"], "--zero-stage 4"),
    ("train-wandb-mode-without-project", "train", tokens, [*TRAIN, "--wandb-mode", "offline"],
     "--wandb-mode offline: no W&B project to log to; give --wandb-project NAME"),
    ("train-wandb-mode-in-config-without-project", "train",
     write("run.toml", '[train]\nwandb_mode = "offline"\n'), [*TRAIN, "--config", "{d}/run.toml"],
     "{d}/run.toml: [train] wandb_mode = 'offline' but no wandb_project"),
    # the data
    ("train-data-missing", "train", tokens, ["--data", "{d}/none.bin"], "--data"),
    ("train-data-shorter-than-seq-len", "train", tiny_tokens, [*TRAIN, "--seq-len", "128"],
     "--seq-len"),
    ("train-init-from-missing", "train", tokens, [*TRAIN, "--init-from", "{d}/weights"],
     "--init-from"),
    ("train-init-from-empty-directory", "train", write("weights/notes.txt", ""),
     [*TRAIN, "--init-from", "{d}/weights"], "holds no complete checkpoint"),
    ("train-metrics-out-no-directory", "train", tokens, [*TRAIN, "--metrics-out", "{d}/no/m.jsonl"],
     "--metrics-out"),
    ("train-checkpoint-dir-under-a-file", "train", write("file", ""),
     [*TRAIN, "--checkpoint-dir", "{d}/file/ckpt"], "--checkpoint-dir {d}/file/ckpt: cannot write"),
    ("train-checkpoint-dir-under-proc", "train", tokens,
     [*TRAIN, "--checkpoint-dir", "/proc/zero_jax/ckpt"], "--checkpoint-dir /proc/zero_jax/ckpt"),
    ("train-tensorboard-dir-under-proc", "train", tokens,
     [*TRAIN, "--tensorboard-dir", "/proc/zero_jax/tb"], "--tensorboard-dir /proc/zero_jax/tb"),
    ("train-hf-vocab-below-the-data", "train", hf_model_and_larger_data,
     [*TRAIN, "--model", "hf:{d}/hf", "--init-from", "{d}/hf"],
     "prepare it with the model's own (zero-jax prepare-data --tokenizer {d}/hf)"),
    ("train-hf-vocab-size-given", "train", hf_model_and_larger_data,
     [*TRAIN, "--model", "hf:{d}/hf", "--init-from", "{d}/hf", "--vocab-size", "8192"],
     "vocab_size 512 there, 8192 in the model; the weights' vocabulary is their tokenizer's: "
     "prepare the data with it (zero-jax prepare-data --tokenizer {d}/hf)"),
    ("train-init-from-safetensors-header-not-json", "train", bad_header,
     [*TRAIN, "--init-from", "{d}/m.safetensors"],
     "{d}/m.safetensors: the safetensors header is not valid JSON (Expecting value at byte 14)"),
    ("train-init-from-hf-header-not-json", "train", hf_model_with_bad_header,
     [*TRAIN, "--model", "hf:{d}/hf", "--init-from", "{d}/hf"],
     "{d}/hf/model.safetensors: the safetensors header is not valid JSON"),
    # the mesh
    ("train-mesh-unknown-name", "train", tokens, [*TRAIN, "--mesh", "gpu-9x9"], "gpu-9x9"),
    ("train-mesh-file-missing", "train", tokens, [*TRAIN, "--mesh", "{d}/mesh.toml"], "mesh.toml"),
    ("train-mesh-file-bad-toml", "train", write("mesh.toml", "[ici\nfsdp = 8\n"),
     [*TRAIN, "--mesh", "{d}/mesh.toml"], "mesh.toml"),
    ("train-mesh-needs-more-devices", "train", tokens, [*TRAIN, "--mesh", "fsdp=16"],
     "needs 16 devices but 8 are present"),
    ("train-mesh-needs-fewer-devices", "train", tokens, [*TRAIN, "--mesh", "data=2,fsdp=2"],
     "needs 4 devices but 8 are present"),
    ("train-batch-not-divisible", "train", tokens, [*TRAIN, "--batch-size", "12"],
     "--batch-size 12 is not divisible by the data-parallel size 8"),
    ("train-lora-init-from-without-rank", "train", tokens,
     [*TRAIN, "--lora-init-from", "{d}/adapters"], "--lora-init-from"),
    ("train-lora-targets-unknown", "train", tokens,
     [*TRAIN, "--model", "llama-tiny", "--lora-rank", "8", "--lora-targets", "q,qkv"],
     "--lora-targets 'q,qkv'"),
    ("train-microbatches-not-divisor", "train", tokens, [*TRAIN, "--microbatches", "3"],
     "--microbatches 3"),
    # scripts/memory_report.py
    ("memory-unknown-model", "memory_report", None, ["--model", "gpt-huge", "--no-compile"],
     "--model 'gpt-huge'"),
    ("memory-unknown-mesh", "memory_report", None, ["--mesh", "tpu-v9", "--no-compile"], "tpu-v9"),
    ("memory-devices-too-few", "memory_report", None,
     ["--mesh", "fsdp=8", "--devices", "4", "--no-compile"], "--devices 4"),
    ("memory-devices-zero", "memory_report", None, ["--devices", "0", "--no-compile"],
     "--devices 0"),
    ("memory-lr-nan", "memory_report", None, ["--lr", "nan", "--no-compile"], "--lr nan"),
    ("memory-remat-table-without-names", "memory_report", None,
     ["--remat-table", "--save-names", ""], "--save-names"),
    ("memory-batch-not-divisible", "memory_report", None,
     ["--mesh", "fsdp=8", "--batch-size", "12", "--no-compile"], "--batch-size 12"),
    # scripts/export.py
    ("export-checkpoint-dir-missing", "export", None,
     ["--checkpoint-dir", "{d}/ckpt", "--out", "{d}/m.safetensors"], "--checkpoint-dir"),
    ("export-checkpoint-dir-empty", "export", mkdir("ckpt"),
     ["--checkpoint-dir", "{d}/ckpt", "--out", "{d}/m.safetensors"], "no complete checkpoint"),
    ("export-unknown-step", "export", checkpoint_steps(4, 8),
     ["--checkpoint-dir", "{d}/ckpt", "--step", "7", "--out", "{d}/m.safetensors"], "--step 7"),
    ("export-out-directory-missing", "export", checkpoint_steps(4),
     ["--checkpoint-dir", "{d}/ckpt", "--out", "{d}/no/m.safetensors"], "--out"),
    ("export-max-shard-size-zero", "export", checkpoint_steps(4),
     ["--checkpoint-dir", "{d}/ckpt", "--hf-dir", "{d}/hf", "--max-shard-size", "0"],
     "--max-shard-size 0"),
    ("export-nothing-to-write", "export", checkpoint_steps(4), ["--checkpoint-dir", "{d}/ckpt"],
     "--out"),
    ("export-peft-dir-of-a-full-checkpoint", "export", checkpoint_steps(4, model=GPT_TINY),
     ["--checkpoint-dir", "{d}/ckpt", "--peft-dir", "{d}/peft"], "not a LoRA run's checkpoint"),
    ("export-with-mtp-without-hf-dir", "export", checkpoint_steps(4),
     ["--checkpoint-dir", "{d}/ckpt", "--out", "{d}/m.safetensors", "--with-mtp"], "--hf-dir"),
    ("export-with-mtp-without-mtp", "export", checkpoint_steps(4, model=GPT_TINY),
     ["--checkpoint-dir", "{d}/ckpt", "--hf-dir", "{d}/hf", "--with-mtp"], "mtp_depth 0"),
    ("export-unknown-dtype", "export", checkpoint_steps(4),
     ["--checkpoint-dir", "{d}/ckpt", "--out", "{d}/m.safetensors", "--dtype", "int8"],
     "argument --dtype: invalid choice: 'int8'"),
    # scripts/launch.py
    ("launch-no-processes", "launch", None, ["-n", "0", "--", "scripts/train.py"], "-n 0"),
    ("launch-no-devices", "launch", None,
     ["-n", "2", "--devices-per-process", "0", "--", "scripts/train.py"],
     "--devices-per-process 0"),
    ("launch-script-missing", "launch", None, ["-n", "2", "--", "{d}/nosuch.py"], "nosuch.py"),
    ("launch-program-missing", "launch", None, ["-n", "2", "--", "no-such-program-zj"],
     "no-such-program-zj"),
    ("launch-no-program", "launch", None, ["-n", "2"], "--"),
    ("launch-bad-port", "launch", None, ["-n", "2", "--port", "70000", "--", "scripts/train.py"],
     "--port 70000"),
    # scripts/plan.py
    ("plan-unknown-cluster", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "b300", "--nodes", "1", "--global-batch", "8",
      "--seq-len", "128"], "--cluster b300"),
    ("plan-unknown-model", "plan", None,
     ["--model", "gpt-huge", "--cluster", "a100-80gb", "--nodes", "1", "--global-batch", "8",
      "--seq-len", "128"], "--model 'gpt-huge'"),
    ("plan-batch-cannot-split", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "a100-80gb", "--nodes", "8", "--gpus-per-node", "1",
      "--global-batch", "7", "--seq-len", "128"], "--global-batch 7: divisible by none"),
    ("plan-no-nodes", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "a100-80gb", "--nodes", "0", "--global-batch", "8",
      "--seq-len", "128"], "--nodes 0"),
    ("plan-bad-stages", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "a100-80gb", "--nodes", "1", "--global-batch", "8",
      "--seq-len", "128", "--stages", "1,x"], "--stages 1,x"),
    ("plan-unknown-stage", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "a100-80gb", "--nodes", "1", "--global-batch", "8",
      "--seq-len", "128", "--stages", "5"], "--stages 5"),
    ("plan-unknown-precision", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "a100-80gb", "--nodes", "1", "--global-batch", "8",
      "--seq-len", "128", "--precision", "fp4"], "--precision 'fp4'"),
    ("plan-seq-len-zero", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "a100-80gb", "--nodes", "1", "--global-batch", "8",
      "--seq-len", "0"], "--seq-len 0"),
    ("plan-gpus-per-node-zero", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "a100-80gb", "--nodes", "1", "--gpus-per-node", "0",
      "--global-batch", "8", "--seq-len", "128"], "--gpus-per-node 0: must be at least 1"),
    ("plan-shape-zero", "plan", None,
     ["--n-layer", "0", "--n-head", "2", "--d-model", "64", "--cluster", "a100-80gb",
      "--nodes", "1", "--global-batch", "8", "--seq-len", "128"], "--n-layer 0: must be at least 1"),
    ("plan-gpus-per-node-negative", "plan", None,
     ["--model", "gpt-tiny", "--cluster", "a100-80gb", "--nodes", "1", "--gpus-per-node", "-8",
      "--global-batch", "8", "--seq-len", "128"], "--gpus-per-node -8: must be at least 1"),
    # scripts/prepare_data.py
    ("prepare-input-missing", "prepare_data", None,
     ["--input", "{d}/none.txt", "--out", "{d}/out"], "--input"),
    ("prepare-input-only-directories", "prepare_data", mkdir("corpus/a"),
     ["--input", "{d}/corpus/*", "--out", "{d}/out"], "--input"),
    ("prepare-out-not-empty", "prepare_data", text_input_and_out,
     ["--input", "{d}/in.txt", "--out", "{d}/out"], "--out"),
    ("prepare-flat-out-exists", "prepare_data", text_input_and_flat_out,
     ["--format", "flat", "--input", "{d}/in.txt", "--out", "{d}/tokens.bin"], "--out"),
    ("prepare-unknown-format", "prepare_data", text_input,
     ["--format", "xml", "--input", "{d}/in.txt", "--out", "{d}/out"], "--format"),
    ("prepare-tokenizer-missing", "prepare_data", text_input,
     ["--input", "{d}/in.txt", "--tokenizer", "{d}/tok", "--out", "{d}/out"], "--tokenizer"),
    ("prepare-tokenizer-not-one", "prepare_data", text_input_and_bad_tokenizer,
     ["--input", "{d}/in.txt", "--tokenizer", "{d}/tokenizer.json", "--out", "{d}/out"],
     "--tokenizer"),
    ("prepare-val-fraction", "prepare_data", text_input,
     ["--input", "{d}/in.txt", "--val-fraction", "1.5", "--out", "{d}/out"], "--val-fraction 1.5"),
    ("prepare-workers-zero", "prepare_data", text_input,
     ["--input", "{d}/in.txt", "--workers", "0", "--out", "{d}/out"], "--workers 0"),
]
USAGE = {"prepare-unknown-format", "export-unknown-dtype"}  # argparse's choices: usage, then the error


class Compiled(AssertionError):
    """A case got past every check."""


@pytest.fixture(autouse=True)
def nothing_compiles_or_spawns(monkeypatch):
    """A case that gets past the checks fails at once, instead of training."""
    from zero_jax import job as job_lib

    def refuse(*args, **kwargs):
        raise Compiled("reached a compile or a process start: the input was not refused")
    for name in ("lower_train_step", "compile_with_text", "compile_train_step"):
        monkeypatch.setattr(job_lib.Job, name, refuse)
    monkeypatch.setattr(script("launch").subprocess, "Popen", refuse)


def run_case(main, setup, argv, tmp_path) -> int:
    """The case's exit status, its directory set up first."""
    if setup is not None:
        setup(tmp_path)
    try:
        return main([a.replace("{d}", str(tmp_path)) for a in argv])
    except SystemExit as e:  # argparse
        return e.code


@pytest.mark.parametrize("name,script_name,setup,argv,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(name, script_name, setup, argv, needle, tmp_path,
                                          capsys):
    code = run_case(script(script_name).main, setup, argv, tmp_path)
    out, err = capsys.readouterr()
    lines = err.strip("\n").splitlines()
    assert code == 2, f"exit {code}; stderr:\n{err}"
    if name in USAGE:
        assert lines[0].startswith("usage:") and ": error: " in lines[-1], err
    else:
        assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle.replace("{d}", str(tmp_path)) in lines[-1], err
    assert "Traceback" not in err + out


FIRST = list({c[1]: c for c in reversed(CASES)}.values())  # each command's first case


@pytest.mark.parametrize("name,script_name,setup,argv,needle", FIRST, ids=[c[0] for c in FIRST])
def test_zero_jax_subcommands_refuse_alike(name, script_name, setup, argv, needle, tmp_path,
                                           capsys):
    """`zero-jax NAME` is the command's own main: the same one line, exit 2."""
    (subcommand,) = [n for n, stem in cli.COMMANDS.items() if stem == script_name]
    code = run_case(lambda args: cli.main([subcommand, *args]), setup, argv, tmp_path)
    lines = capsys.readouterr().err.strip("\n").splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert needle in lines[0]


@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0"])
def test_launch_refuses_a_port_in_use_before_starting_anything(address, tmp_path, capsys):
    """A coordinator port another program listens on: one line naming it
    and the way out, not a traceback from every process once started."""
    with socket.socket() as held:
        held.bind((address, 0))
        held.listen()
        port = held.getsockname()[1]
        code = run_case(script("launch").main, None,
                        ["-n", "2", "--port", str(port), "--", "scripts/train.py"], tmp_path)
    lines = capsys.readouterr().err.strip("\n").splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"error: --port {port}: already in use on this machine; give a free "
                        "port, or --port 0 (the default) for the launcher to pick one"), lines


def test_a_committed_step_without_its_meta_is_a_damaged_checkpoint(tmp_path, capsys):
    """Exit 4 (a checkpoint that cannot be used), in one line naming the file."""
    checkpoint_steps(4, meta=False)(tmp_path)
    code = script("export").main(["--checkpoint-dir", str(tmp_path / "ckpt"),
                                  "--out", str(tmp_path / "m.safetensors")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 4 and len(lines) == 1, lines
    assert lines[0].startswith("error: checkpoint step 4 in ") and "meta/metadata" in lines[0]
    assert "nothing written" in lines[0]


@pytest.mark.parametrize("mesh,given,devices,note", [
    ("tpu-v5p-64", None, 32, False),  # the slice's 32 chips, as its file says
    ("gpu-4x8", None, 32, False),
    ("data=2,fsdp=-1", None, 8, True),  # -1 has no count to fill from: a guess, said
    ("data=3,fsdp=-1", None, 9, True),
    ("data=2,fsdp=-1", 16, 16, False),
])
def test_memory_report_simulates_the_mesh_as_configured(mesh, given, devices, note):
    from zero_jax.sharding import mesh as mesh_lib
    count, said = script("memory_report").devices_for(mesh_lib.load(mesh), given)
    assert count == devices and bool(said) == note
    assert not note or f"reporting for {devices} simulated devices" in said
