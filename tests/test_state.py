"""Sharded initialisation creates the same state whatever the layout."""

import jax
import numpy as np

from tests.helpers import host, make_job


def test_sharded_init_equals_one_device_init(corpus):
    one = host(make_job(corpus, mesh="fsdp=1", zero_stage=0, devices=jax.devices()[:1]).init_state())
    for overrides in (dict(mesh="fsdp=8", zero_stage=3),
                      dict(mesh="data=2,fsdp=2,tensor=2", layout="fsdp_tp_sp", zero_stage=1)):
        job = make_job(corpus, **overrides)
        state = job.init_state()
        assert state.params["blocks"]["w_fc"].sharding == job.state_plan.shardings.params["blocks"]["w_fc"]
        jax.tree.map(np.testing.assert_array_equal, host(state), one)
