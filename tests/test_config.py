"""Bad input gets one clear error from `prepare`, before anything compiles."""

import jax
import pytest

import models
from tests.helpers import make_job
from zero_jax.config import flags
from zero_jax import config as config_lib, job as job_lib, run as run_lib
from zero_jax.sharding.mesh import MeshError
from zero_jax.sharding.rules import ShardingError


@pytest.mark.parametrize("overrides,error,message", [
    ({"mesh": "fsdp=4"}, MeshError, "needs 4 devices but 8 are present"),
    ({"mesh": "fsdp=8,experts=1"}, MeshError, "unknown axis 'experts'"),
    ({"mesh": "fsdp=4,tensor=2", "layout": "fsdp"}, ShardingError, "splits nothing over the mesh's tensor=2"),
    ({"layout": "megatron"}, config_lib.ConfigError, "--layout 'megatron': choose from auto, dp, fsdp"),
    ({"precision": "fp4"}, config_lib.ConfigError, "--precision 'fp4': choose from auto, fp32, bf16, fp16, fp8"),
    ({"remat": "some"}, config_lib.ConfigError, "--remat 'some': choose from none, full"),
    ({"seq_len": 512}, config_lib.ConfigError, "--seq-len 512 exceeds the model's 256 positions"),
    ({"batch_size": 12}, config_lib.ConfigError, "--batch-size 12 is not divisible by the data-parallel size 8"),
    ({"batch_size": 32, "microbatches": 3}, config_lib.ConfigError, "--microbatches 3 does not divide --batch-size 32"),
    ({"batch_size": 32, "microbatches": 8}, config_lib.ConfigError, "4 rows per microbatch, not divisible by the data-parallel size 8"),
    ({"zero_stage": 5}, ValueError, "choose 0"),
    ({"optimizer": "adam"}, config_lib.ConfigError, "choose from adamw, sgd, adafactor"),
    ({"grad_reduce": "sometimes"}, config_lib.ConfigError, "choose from auto, step, microbatch"),
    ({"grad_reduce": "microbatch", "zero_stage": 1}, config_lib.ConfigError,
     "gradients are replicated at stages 0 and 1"),
    ({"model": "", "n_layer": 2}, ValueError, "no model preset, so the shape needs n_head, d_model"),
    ({"vocab_size": 100}, ValueError, r"vocabulary \(100, --vocab-size\) is smaller than the "
                                      r"data's \(256\).*use --vocab-size 256 or more"),
    ({"n_layer": -2}, config_lib.ConfigError, "shape fields must be positive"),
])
def test_bad_input_is_one_clear_error(corpus, overrides, error, message):
    compiles = []

    def listen(name, secs, **kw):
        if "backend_compile" in name:
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with pytest.raises(error, match=message):
            make_job(corpus, **overrides)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == [], "the error must come before anything is compiled"


def test_model_shape_from_the_run_config(corpus, tmp_path):
    """Shape fields on top of a preset, or with none; recorded in checkpoints."""
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "gpt-tiny"\nn_layer = 6\nd_model = 256\nn_head = 4\n')
    run = config_lib.build(str(path))
    build, line = models.for_run(run.model, corpus.vocab_size)
    cfg = job_lib.prepare(run, build).model.config
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_mlp, cfg.max_seq_len, cfg.vocab_size) == \
        (6, 256, 4, 1024, 256, 256)
    assert line.startswith("gpt-tiny with n_layer, n_head, d_model set: 6 layers")
    custom = make_job(corpus, model="", n_layer=2, n_head=4, d_model=64, max_seq_len=64)
    assert custom.model.config.d_mlp == 256 and custom.model.layers == 2
    assert run_lib.checkpoint_meta(custom, 0)["model"]["d_model"] == 64
    bloom = models.gpt.model.config("bloom-176b", 256)  # the preset's own vocabulary
    assert (bloom.n_layer, bloom.d_model, bloom.n_head, bloom.vocab_size, bloom.max_seq_len) == \
        (70, 14336, 112, 250880, 2048)
    assert 176.2e9 < bloom.param_count < 176.3e9
    assert 174e9 < models.gpt.model.config("gpt3-175b", 256).param_count < 175e9
    assert 529e9 < models.gpt.model.config("mt-nlg-530b", 256).param_count < 530e9


def test_toml_file_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[parallel]\nmesh = "data=2,fsdp=4"\nzero_stage = 1\n'
                    "[train]\nsteps = 7\nbatch_size = 64\n[optim]\nlr = 1\n")
    run = config_lib.build(str(path), {"train.steps": 3, "train.seed": None})
    assert run.parallel.mesh == "data=2,fsdp=4" and run.parallel.zero_stage == 1
    assert run.train.steps == 3 and run.train.batch_size == 64 and run.optim.lr == 1.0


@pytest.mark.parametrize("text,message", [
    ("[train]\nstepz = 3\n", r"\[train\]: unknown key\(s\) \['stepz'\]"),
    ("[trian]\nsteps = 3\n", r"unknown table\(s\) \['trian'\]"),
    ('[train]\nsteps = "3"\n', r"\[train\].steps = '3': expected int"),
    ("[model\nname = 'gpt-tiny'\n", r"run.toml: not valid TOML \(Expected ']'"),
    ("[optim]\nlr = nan\n", r"\[optim\]: --lr nan: must be a finite number in \(0, inf\)"),
    ("[optim]\nb2 = 1.5\n", r"\[optim\]: --b2 1.5: must be a finite number in \[0, 1\)"),
])
def test_bad_toml_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.build(str(path))


def test_flags_are_described_by_the_fields_comments():
    import argparse
    assert flags.field_comments(config_lib.TrainConfig)["steps"] == \
        "optimizer steps (the schedule's length)"
    assert flags.field_comments(config_lib.ModelConfig)["name"].startswith(
        "a preset in models/ (gpt-tiny")  # the comment above the field
    parser = argparse.ArgumentParser()
    flags.add_flags(parser)
    text = " ".join(parser.format_help().split())
    assert "--steps INT optimizer steps (the schedule's length) (default: 300)" in text
    assert "--remat STR none | full | dots_saveable | save_names | offload (default: 'none')" in text
    assert "--keep-last INT keep the newest K complete checkpoints (default: 3)" in text  # checkpoint/manager.py


def test_every_field_has_a_flag():
    import argparse
    parser = argparse.ArgumentParser()
    flags.add_flags(parser)
    args = parser.parse_args(["--model", "gpt-small", "--mesh", "data=8", "--zero-stage", "2",
                              "--batch-size", "64", "--microbatches", "4", "--seq-len", "256",
                              "--steps", "9", "--lr", "0.01", "--seed", "3", "--data", "x.bin",
                              "--metrics-out", "m.jsonl", "--optimizer", "sgd"])
    run = flags.from_args(args, None)
    assert (run.model.name, run.parallel.mesh, run.parallel.zero_stage, run.train.batch_size,
            run.train.microbatches, run.data.seq_len, run.train.steps, run.optim.lr,
            run.train.seed, run.data.source, run.train.metrics_out, run.optim.name) == (
        "gpt-small", "data=8", 2, 64, 4, 256, 9, 0.01, 3, "x.bin", "m.jsonl", "sgd")


def test_train_py_reports_a_bad_config_in_one_line(tmp_path):
    """Config errors end the script with one line on stderr and status 2,
    never a traceback."""
    import subprocess
    import sys
    from pathlib import Path

    bad = tmp_path / "run.toml"
    bad.write_text("[model\n")
    root = Path(__file__).resolve().parent.parent
    for args, message in [(["--config", str(bad)], f"error: --config {bad}: not valid TOML"),
                          (["--lr", "nan"], "error: [optim]: --lr nan: must be a finite number"),
                          (["--config", str(tmp_path / "none.toml")],
                           f"error: --config {tmp_path / 'none.toml'}: no such file")]:
        p = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=root,
                           capture_output=True, text=True, timeout=120)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), p.stderr
