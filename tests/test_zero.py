"""The ZeRO stage table, the sharding rule, and any optax optimizer."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.helpers import assert_close, host, make_job, train
from zero_jax.train import state as state_lib
from zero_jax.sharding import zero

SNAPSHOT = Path(__file__).parent / "snapshots" / "state_specs_gpt_tiny_fsdp8.json"


def test_rule_takes_the_largest_free_divisible_dimension():
    assert zero.zero_dim((192, 768), P(), ("embed", "mlp"), 8, 0) == (1, "")
    assert zero.zero_dim((768, 768), P(), None, 8, 0) == (0, "")  # ties: the first
    assert zero.zero_dim((768, 100), P(), None, 8, 0) == (0, "")  # 100 is indivisible
    assert zero.zero_dim((768, 192), P("tensor"), None, 8, 0) == (1, "")  # 768 is taken


def test_rule_skips_tiny_arrays_and_the_layers_dimension_and_says_why():
    dim, why = zero.zero_dim((4, 192), P(), ("layers", "embed"), 8, 4096)
    assert dim is None and "192 elements per layer < min_shard_elements=4096" in why
    # Counted per layer: a stack of 4 x 2048 is tiny even though it holds 8192 elements.
    assert zero.zero_dim((4, 2048), P(), ("layers", "embed"), 8, 4096)[0] is None
    assert zero.zero_dim((4, 4096), P(), ("layers", "embed"), 8, 4096)[0] == 1
    assert zero.zero_dim((8, 100), P(), ("layers", "embed"), 8, 0)[0] is None
    dim, why = zero.zero_dim((6, 10), P(), None, 8, 0)
    assert dim is None and "no free dimension divisible by 8" in why


def test_stage_table():
    rows = {s: (t.opt_state, t.grads, t.params) for s, t in zero.STAGES.items()}
    assert rows == {0: (False, False, False), 1: (True, False, False),
                    2: (True, True, False), 3: (True, True, True)}
    with pytest.raises(ValueError, match="choose 0"):
        zero.stage(4)


def _spec_table(state_plan):
    def flat(tree):
        leaves = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, P))[0]
        return {jax.tree_util.keystr(p, simple=True, separator="."): str(s) for p, s in leaves}
    return {"params": flat(state_plan.specs.params), "grads": flat(state_plan.specs.grads),
            "opt_state": flat(state_plan.specs.opt_state)}


def test_snapshot_of_every_state_leaf_spec_per_stage(corpus):
    """The PartitionSpec of every leaf of the train state, for each stage.

    Regenerate with ZERO_JAX_UPDATE_SNAPSHOTS=1 after an intended change, and
    review the diff: it is the whole sharding layout.
    """
    table = {str(s): _spec_table(make_job(corpus, zero_stage=s).state_plan) for s in range(4)}
    if os.environ.get("ZERO_JAX_UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    assert table == json.loads(SNAPSHOT.read_text())


# CI runs the least Adam-like; ZERO_JAX_FULL_GRID=1 all three.
OPTIMIZERS = [("adamw", 3, "fp32"), ("sgd", 1, "bf16"), ("adafactor", 2, "bf16")]


@pytest.mark.parametrize("optimizer,stage,precision",
                         OPTIMIZERS if os.environ.get("ZERO_JAX_FULL_GRID") else OPTIMIZERS[2:])
def test_any_optax_optimizer_shards_and_matches_one_device(corpus, optimizer, stage, precision):
    """Any optax transformation, its state sharded; under bf16 at stages 1-2
    wrapped with float32 master weights (bf16 tolerances: test_numerics.py)."""
    kw = dict(optimizer=optimizer, precision=precision, steps=10)
    ref, ref_state = train(make_job(corpus, mesh="fsdp=1", zero_stage=0, devices=jax.devices()[:1],
                                    **kw), corpus)
    job = make_job(corpus, zero_stage=stage, **kw)
    assert job.state_plan.master == (precision == "bf16")
    # Optimizer-state leaves that mirror a parameter carry its ZeRO layout.
    sharded = [s for s in jax.tree.leaves(job.state_plan.specs.opt_state, is_leaf=lambda x: isinstance(x, P))
               if "fsdp" in str(s)]
    assert sharded, f"{optimizer}: no optimizer-state leaf is sharded"
    losses, state = train(job, corpus)
    saved = state_lib.saved_form(state)  # master weights and the optimizer's own state
    if precision == "fp32":
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        assert_close(saved.params, ref_state.params)
        assert_close(saved.opt_state, ref_state.opt_state)
    else:  # bf16: single tensors drift further (test_numerics.py), the whole does not
        np.testing.assert_allclose(losses, ref, rtol=3e-4)
        flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(host(t))])
        a, b = flat(saved.params), flat(ref_state.params)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) <= 1e-4


def test_hybrid_sharding_replicates_across_data(corpus):
    """zero_shard_axes=fsdp: states split over fsdp only, replicated over data (HSDP)."""
    job = make_job(corpus, mesh="data=2,fsdp=4", zero_shard_axes="fsdp")
    w = job.state_plan.specs.params["blocks"]["w_fc"]
    assert w == P(None, None, "fsdp")
    full = make_job(corpus, mesh="data=2,fsdp=4")
    assert full.state_plan.specs.params["blocks"]["w_fc"] == P(None, None, ("data", "fsdp"))
