"""Logical names -> PartitionSpecs, with errors naming the array and sizes."""

import pytest
from jax.sharding import PartitionSpec as P

import dataclasses

from models import gpt
from zero_jax import config as config_lib, job as job_lib
from zero_jax.sharding.rules import PRESETS, AxisRules, ShardingError, preset

SIZES = {"pipe": 1, "data": 2, "fsdp": 4, "tensor": 2}


def test_spec_maps_names_and_drops_size_one_axes():
    rules = PRESETS["fsdp_tp"].rules
    assert rules.spec(("batch", "seq", "embed"), (8, 16, 32), SIZES) == P(("data", "fsdp"), None, None)
    assert rules.spec(("embed", "mlp"), (32, 64), SIZES) == P(None, "tensor")
    assert rules.spec(("embed", "mlp"), (32, 64), {**SIZES, "tensor": 1}) == P(None, None)


def test_two_logical_axes_on_one_mesh_axis_is_an_error():
    with pytest.raises(ShardingError, match="'heads' .* and 'mlp' .* both map to mesh axis 'tensor'"):
        PRESETS["fsdp_tp"].rules.spec(("heads", "mlp"), (4, 8), SIZES, what="parameter w")


def _job(corpus, mesh, vocab_multiple=1, **model):
    cfg = gpt.model.GPTConfig(**{"vocab_size": 256, "n_layer": 2, "n_head": 8, "d_model": 192,
                           "d_mlp": 768, "max_seq_len": 64, **model})
    run = config_lib.build(None, {"parallel.mesh": mesh, "data.seq_len": 32,
                                  "train.batch_size": 16, "model.vocab_multiple": vocab_multiple})
    return job_lib.prepare(run, lambda multiple: gpt.model.model_fns(
        dataclasses.replace(cfg, vocab_multiple=multiple)))


def test_indivisible_heads_name_parameter_dim_size_and_axes(corpus):
    with pytest.raises(ShardingError) as e:
        _job(corpus, "fsdp=2,tensor=4", n_head=6, d_model=192)
    msg = str(e.value)
    assert "parameter blocks" in msg and "'heads'" in msg
    assert "size 6" in msg and "tensor=4" in msg and "number of heads divisible by 4" in msg


def test_indivisible_vocabulary_says_to_pad_it(corpus):
    with pytest.raises(ShardingError, match=r"parameter wte: dimension 0 \('vocab'\) has size 257.*"
                                            r"--vocab-multiple"):
        _job(corpus, "fsdp=4,tensor=2", vocab_size=257)
    job = _job(corpus, "fsdp=4,tensor=2", vocab_size=257, vocab_multiple=128)
    assert job.state_plan.abstract.params["wte"].shape == (384, 192)


def test_layout_must_use_the_tensor_axis():
    with pytest.raises(ShardingError, match="splits nothing over the mesh's tensor=2 axis"):
        preset("fsdp", {"fsdp": 4, "tensor": 2})
    assert preset("auto", {"fsdp": 4, "tensor": 2}).rules.name == "fsdp_tp"
    assert preset("auto", {"fsdp": 8, "tensor": 1}).rules.name == "fsdp"


def test_unknown_logical_name_is_an_error():
    with pytest.raises(ShardingError, match="no rule for logical axis 'hidden'"):
        PRESETS["fsdp_tp"].rules.spec(("hidden",), (8,), SIZES)


def test_rules_reject_a_name_mapped_twice():
    with pytest.raises(ShardingError, match="mapped twice"):
        AxisRules("x", (("embed", ()), ("embed", ("tensor",))))
