"""The pipeline's cut of the layer stack: balance, slots, and the way back
to layer order."""

import jax.numpy as jnp
import numpy as np
import pytest

from zero_jax.pipeline.cut import Stages, balanced


def stage_costs(stages: Stages, ends: float = 1.0) -> tuple[float, ...]:
    """Each chunk's work in layers, the embedding and head `ends` layers each."""
    return tuple(c + ends * ((g == 0) + (g == stages.chunks - 1))
                 for g, c in enumerate(stages.counts))


@pytest.mark.parametrize("layers,p,v,counts", [
    (70, 12, 1, (5,) + (6,) * 10 + (5,)),  # BLOOM-176B: 72 units of work, 6 per stage
    (10, 4, 1, (2, 3, 3, 2)),
    (6, 4, 1, (1, 2, 2, 1)),
    (8, 4, 1, (2, 2, 2, 2)),  # no padding where it costs no balance
    (96, 8, 1, (12,) * 8),
    (8, 4, 2, (1,) * 8),
])
def test_balanced_cut(layers, p, v, counts):
    stages = balanced(layers, p, v)
    assert stages.counts == counts and sum(stages.counts) == layers
    # The largest work is the bound: ceil((L + 2) / G), embedding and head a layer each.
    assert max(stage_costs(stages)) == -(-(layers + 2) // (p * v))


@pytest.mark.parametrize("layers,p,v", [(10, 4, 1), (70, 12, 1), (10, 2, 2), (8, 4, 2), (8, 4, 1)])
def test_slots_hold_each_layer_once_and_unpad_inverts_pad(layers, p, v):
    stages = balanced(layers, p, v)
    where = stages.slot_layers()
    assert sorted(where[where >= 0].tolist()) == list(range(layers))
    x = jnp.arange(layers * 3, dtype=jnp.float32).reshape(layers, 3)
    padded = stages.pad(x)
    assert padded.shape == (stages.padded, 3)
    assert float(jnp.abs(padded[where < 0]).sum()) == 0  # padding holds zeros
    np.testing.assert_array_equal(stages.unpad(padded), x)
    # Device d's slots hold chunks d, d + p, ...: the layers in its own part.
    per_device = where.reshape(p, v, stages.slots)
    first = stages.first_layer
    for d in range(p):
        for k in range(v):
            g = k * p + d
            assert per_device[d, k, :stages.counts[g]].tolist() == list(
                range(first[g], first[g] + stages.counts[g]))


def test_more_chunks_than_layers_is_an_error():
    with pytest.raises(ValueError, match="6 layers cannot fill 8 stages"):
        balanced(6, 8)
