"""Logical names -> PartitionSpecs, with errors naming the array and sizes."""

import pytest
from jax.sharding import PartitionSpec as P

from tests.helpers import make_job
from zero_jax.rules import AxisRules, ShardingError, preset

SIZES = {"pipe": 1, "data": 2, "fsdp": 4, "tensor": 2}


def test_spec_maps_names_and_drops_size_one_axes():
    rules = preset("default")
    assert rules.spec(("batch", "seq", "embed"), (8, 16, 32), SIZES) == P(("data", "fsdp"), None, None)
    assert rules.spec(("embed", "mlp"), (32, 64), SIZES) == P(None, "tensor")
    assert rules.spec(("embed", "mlp"), (32, 64), {**SIZES, "tensor": 1}) == P(None, None)


def test_two_logical_axes_on_one_mesh_axis_is_an_error():
    with pytest.raises(ShardingError, match="'heads' .* and 'mlp' .* both map to mesh axis 'tensor'"):
        preset("default").spec(("heads", "mlp"), (4, 8), SIZES, what="parameter w")


def test_indivisible_dimension_names_parameter_dim_size_and_axes(corpus):
    # gpt-tiny has 6 heads; tensor=4 cannot split them.
    with pytest.raises(ShardingError) as e:
        make_job(corpus, mesh="fsdp=2,tensor=4")
    msg = str(e.value)
    assert "parameter" in msg and "blocks" in msg and "'heads'" in msg
    assert "size 6" in msg and "tensor=4" in msg


def test_unknown_logical_name_is_an_error():
    with pytest.raises(ShardingError, match="no rule for logical axis 'hidden'"):
        preset("default").spec(("hidden",), (8,), SIZES)


def test_rules_reject_a_name_mapped_twice():
    with pytest.raises(ShardingError, match="mapped twice"):
        AxisRules("x", (("embed", ()), ("embed", ("tensor",))))
