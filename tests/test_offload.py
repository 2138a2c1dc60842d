"""Host offload (offload.py): the optimizer state, with the master weights,
lives in host memory and is updated there; at ZeRO-3 the stored parameters
may live there too, fetched layer by layer; and the run computes what it
computes without offload.

CI runs stage 1 on data=2,fsdp=4 and ZeRO-3 on fsdp=8 with both the
parameters and the optimizer offloaded (stage 2 offload trains in the
checkpoint test); ZERO_JAX_FULL_GRID=1 runs all six optimizer-offload cases
and all four parameter-offload ones.
"""

import functools
import itertools
import os
import re

import jax
import numpy as np
import pytest

from tests.helpers import assert_close, compile_step, host, initial_state, make_job, train
from zero_jax import config as config_lib, run
from zero_jax.checkpoint import manager as manager_lib
from zero_jax.data import corpus as corpus_lib
from zero_jax.analysis import memory

GRID = list(itertools.product(("fsdp=8", "data=2,fsdp=4"), (1, 2, 3)))
CASES = GRID if os.environ.get("ZERO_JAX_FULL_GRID") else [("data=2,fsdp=4", 1)]
# Parameter offload at ZeRO-3, with and without the optimizer offloaded too.
# In CI the case with both offloaded also stands for optimizer offload at ZeRO-3.
PARAM_GRID = list(itertools.product(("fsdp=8", "data=2,fsdp=4"), (False, True)))
PARAM_CASES = PARAM_GRID if os.environ.get("ZERO_JAX_FULL_GRID") else [("fsdp=8", True)]


def _steps(job, corpus, state, first, last):
    """Steps `first` to `last`, checking after each that the optimizer state
    is in host memory where the job offloads it; returns losses and state."""
    step_fn = compile_step(job)
    t = job.run.train
    batch = functools.partial(corpus_lib.global_batch, corpus, "train", job.run.data.seq_len,
                              t.batch_size, t.seed, sharding=job.state_plan.batch_sharding)
    opt_kind = "pinned_host" if job.run.offload.optimizer else "device"
    params_kind = "pinned_host" if job.run.offload.params else "device"
    losses = []
    for i in range(first, last):
        state, metrics = step_fn(state, batch(step=i))
        losses.append(float(metrics["loss"]))
        kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)}
        assert kinds == {opt_kind}, (i, kinds)
        kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)}
        assert kinds == {params_kind}, (i, kinds)
    return np.array(losses), state


@pytest.mark.parametrize("mesh,stage", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_ten_steps_match_the_run_without_offload(corpus, mesh, stage):
    """bf16 with float32 masters: at stages 1 and 2 the masters are in the
    offloaded optimizer state, at stage 3 the stored parameters."""
    shape = dict(mesh=mesh, zero_stage=stage, precision="bf16")
    job = make_job(corpus, **shape, offload_optimizer=True)
    losses, state = _steps(job, corpus, initial_state(job), 0, job.run.train.steps)
    ref_losses, ref = train(make_job(corpus, **shape), corpus)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_close(host(state.params), host(ref.params), 1e-6)
    assert_close(host(state.opt_state), host(ref.opt_state), 1e-6)


@pytest.mark.parametrize("mesh,with_optimizer", PARAM_CASES,
                         ids=[f"{m}-{'opt' if o else 'params'}" for m, o in PARAM_CASES])
def test_parameter_offload_matches_the_run_without_offload(corpus, mesh, with_optimizer):
    """ZeRO-3, bf16: the stored (float32) parameter shards stay in host
    memory across ten steps, alone or with the optimizer state."""
    shape = dict(mesh=mesh, zero_stage=3, precision="bf16")
    job = make_job(corpus, **shape, offload_params=True, offload_optimizer=with_optimizer)
    losses, state = _steps(job, corpus, initial_state(job), 0, job.run.train.steps)
    ref_losses, ref = train(make_job(corpus, **shape), corpus)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_close(host(state.params), host(ref.params), 1e-6)
    assert_close(host(state.opt_state), host(ref.opt_state), 1e-6)


def test_parameters_are_fetched_one_layer_at_a_time(corpus):
    """Lowered for a GPU (XLA:CPU drops placement inside a program), the
    step moves each stacked parameter to the device one layer's slice at a
    time, inside the layer loop, and never the whole stack. (With the
    optimizer offloaded too: an update on the device fetches the whole
    parameter shard, beside the optimizer state it updates it with.)"""
    job = make_job(corpus, zero_stage=3, offload_params=True, offload_optimizer=True)
    text = job.jit_train_step().trace(job.state_plan.abstract, job.abstract_batch).lower(
        lowering_platforms=("cuda",)).as_text()
    fetched = re.findall(r"annotate_device_placement\(%[\w#]+\).*_xla_buffer_placement = "
                         r'"device".*\((tensor<[^>]*>)\)', text)
    stacked = [leaf.shape for leaf, st in zip(jax.tree.leaves(job.state_plan.abstract.params),
                                               jax.tree.leaves(job.state_plan.stacked[0])) if st]
    as_tensor = lambda shape: "tensor<" + "x".join(map(str, shape)) + "xf32>"
    assert stacked and fetched
    for shape in stacked:
        assert as_tensor(shape) not in fetched  # never the whole stack
        assert as_tensor(shape[1:]) in fetched  # one layer's slice


def test_parameter_offload_needs_zero_3_and_no_pipeline(corpus):
    with pytest.raises(config_lib.ConfigError, match="use --zero-stage 3"):
        make_job(corpus, zero_stage=2, offload_params=True)
    with pytest.raises(config_lib.ConfigError, match="not supported with pipelining"):
        make_job(corpus, mesh="pipe=2,fsdp=4", zero_stage=3, offload_params=True)


def test_the_compiled_step_updates_on_the_host(corpus):
    """The update's instructions carry the host compute type and its buffers
    the host memory space, S(5), in the compiled program; without offload,
    neither appears."""
    text = {off: compile_step(make_job(corpus, zero_stage=2, precision="bf16",
                                       offload_optimizer=off)).as_text() for off in (True, False)}
    assert text[True].count('_xla_compute_type="host"') > 0
    assert text[True].count("S(5)") > 0
    assert '_xla_compute_type="host"' not in text[False] and "S(5)" not in text[False]


def test_offload_at_stage_0_is_refused_before_compiling(corpus):
    with pytest.raises(config_lib.ConfigError, match="use --zero-stage 1 or more"):
        make_job(corpus, zero_stage=0, offload_optimizer=True)


def test_checkpoints_move_between_host_and_device_layouts_exactly(corpus, tmp_path):
    """Saved with offload (fsdp=8, ZeRO-2, bf16: the masters are in the
    offloaded optimizer state), restored without it on data=2,fsdp=4 ZeRO-1,
    and back into host memory, and onto ZeRO-3 with the parameters in host
    memory too: bit for bit every way (a restore also checks
    every array against its saved checksum); five more steps from the
    restored state give the uninterrupted run's losses to 1e-6."""
    off = make_job(corpus, mesh="fsdp=8", zero_stage=2, precision="bf16", offload_optimizer=True)
    _, state = _steps(off, corpus, initial_state(off), 0, 5)
    saved = host(off.state_plan.saved_form(state))
    writer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path)), off.state_plan.names,
                                   writer=True)
    writer.save(5, off.state_plan.saved_form(state), run.checkpoint_meta(off, 5))
    writer.wait()
    uninterrupted, _ = _steps(off, corpus, state, 5, 10)

    reader = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path)))
    plain = make_job(corpus, mesh="data=2,fsdp=4", zero_stage=1, precision="bf16")
    moved, _ = reader.restore(5, plain.state_plan.targets)
    jax.tree.map(np.testing.assert_array_equal, host(moved), saved)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(moved.opt_state)} == {"device"}

    back, _ = reader.restore(5, off.state_plan.targets)
    jax.tree.map(np.testing.assert_array_equal, host(back), saved)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(back.opt_state)} == {"pinned_host"}

    # Onto ZeRO-3 with the parameters in host memory too.
    both = make_job(corpus, mesh="data=2,fsdp=4", zero_stage=3, precision="bf16",
                    offload_optimizer=True, offload_params=True)
    all_host, _ = reader.restore(5, both.state_plan.targets)
    jax.tree.map(np.testing.assert_array_equal, host(all_host), saved)
    assert {x.sharding.memory_kind for x in jax.tree.leaves((all_host.params, all_host.opt_state))
            } == {"pinned_host"}
    losses, _ = _steps(off, corpus, off.state_plan.from_saved(back), 5, 10)
    np.testing.assert_allclose(losses, uninterrupted, rtol=1e-6)


def test_bytes_split_between_device_and_host_memory(corpus):
    """gpt-7b on fsdp=8, bf16, ZeRO-2 with float32 gradients (g = 4 bytes):
    the device keeps the bf16 working copy and its shard of the gradients,
    2 + g/8 bytes per parameter; the host the optimizer state with the
    masters, 12/8. From the shapes and shardings only."""
    job = make_job(corpus, model="gpt-7b", vocab_size=50257, seq_len=2048, batch_size=8,
                   precision="bf16", zero_stage=2, offload_optimizer=True)
    split = memory.by_memory_kind(job.state_plan)
    n = memory.param_count(job.state_plan)
    assert sum(split["device"].values()) / n == pytest.approx(2 + 4 / 8, rel=0.005)
    assert split["host"] == {"params": 0, "grads": 0, "opt_state": split["host"]["opt_state"]}
    assert split["host"]["opt_state"] / n == pytest.approx(12 / 8, rel=0.005)
