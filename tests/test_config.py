"""Bad input gets one clear error from `prepare`, before anything compiles."""

import jax
import pytest

from tests.helpers import make_job
from zero_jax import config as config_lib
from zero_jax.mesh import MeshError
from zero_jax.rules import ShardingError


@pytest.mark.parametrize("overrides,error,message", [
    ({"mesh": "fsdp=4"}, MeshError, "needs 4 devices but 8 are present"),
    ({"mesh": "fsdp=8,expert=1"}, MeshError, "unknown axis 'expert'"),
    ({"mesh": "fsdp=4,tensor=2", "layout": "fsdp"}, ShardingError, "splits nothing over the mesh's tensor=2"),
    ({"layout": "megatron"}, ShardingError, "unknown layout 'megatron'"),
    ({"precision": "fp8"}, config_lib.ConfigError, "precision 'fp8': choose auto or one of fp32, bf16, fp16"),
    ({"remat": "some"}, config_lib.ConfigError, "remat policy 'some'"),
    ({"seq_len": 512}, config_lib.ConfigError, "--seq-len 512 exceeds the model's 256 positions"),
    ({"batch_size": 12}, config_lib.ConfigError, "--batch-size 12 is not divisible by the data-parallel size 8"),
    ({"batch_size": 32, "microbatches": 3}, config_lib.ConfigError, "--microbatches 3 does not divide --batch-size 32"),
    ({"batch_size": 32, "microbatches": 8}, config_lib.ConfigError, "4 rows per microbatch, not divisible by the data-parallel size 8"),
    ({"zero_stage": 5}, ValueError, "choose 0"),
    ({"optimizer": "adam"}, config_lib.ConfigError, "choose from adamw, sgd, adafactor"),
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
])
def test_bad_toml_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.build(str(path))


def test_every_field_has_a_flag():
    import argparse
    parser = argparse.ArgumentParser()
    config_lib.add_flags(parser)
    args = parser.parse_args(["--model", "gpt-small", "--mesh", "data=8", "--zero-stage", "2",
                              "--batch-size", "64", "--microbatches", "4", "--seq-len", "256",
                              "--steps", "9", "--lr", "0.01", "--seed", "3", "--data", "x.bin",
                              "--metrics-out", "m.jsonl", "--optimizer", "sgd"])
    run = config_lib.from_args(args, None)
    assert (run.model.name, run.parallel.mesh, run.parallel.zero_stage, run.train.batch_size,
            run.train.microbatches, run.data.seq_len, run.train.steps, run.optim.lr,
            run.train.seed, run.data.source, run.train.metrics_out, run.optim.name) == (
        "gpt-small", "data=8", 2, 64, 4, 256, 9, 0.01, 3, "x.bin", "m.jsonl", "sgd")
