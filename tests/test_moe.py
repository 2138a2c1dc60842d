"""Mixtures of experts (models/llama/moe.py): routing and both dispatch modes
against a per-token reference, the published parameter counts, every
expert-parallel layout against one device, the all-to-alls of the compiled
step against their formula, and bad input.

CI runs one layout of the grid (ZeRO-3 with tensor parallelism; the
expert=4,data=2 step is compiled by the all-to-all test), bf16 on it, and
one pipeline with the router losses; ZERO_JAX_FULL_GRID=1 runs every
layout, the capacity mode, shared experts and every pipeline schedule.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.llama import moe
from tests.helpers import assert_close, compile_step, host, initial_state, make_job
from zero_jax import config as config_lib
from zero_jax.analysis import hlo, traffic
from zero_jax.data import corpus as corpus_lib
from zero_jax.model import grouped

FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
RTOL = 1e-5
# (mesh, ZeRO stage, extra fields)
GRID = [("expert=4,data=2", 1, {}), ("expert=2,fsdp=2,tensor=2", 3, {}),
        ("expert=2,fsdp=4", 1, {}), ("expert=2,fsdp=4", 3, {}), ("expert=4,data=2", 3, {}),
        # a capacity large enough to drop nothing computes what dropless does
        ("expert=4,data=2", 1, {"capacity_factor": 4.0})]
# Shared experts change the model: a reference of their own (FULL only).
SHARED = dict(n_shared_experts=1)
CASES = GRID if FULL else GRID[1:2]
# Pipelines with the router losses: (mesh, schedule, microbatches, ZeRO
# stage, devices). Interleaved stores the stack out of layer order (the
# expert loads come back through the cut's unpad); pipe=3 on 6 devices cuts
# moe-tiny's 4 layers 1, 2, 1 (padding slots); zb-h1 seeds the router term
# in its input-gradient backward (B) and leaves the router's matrix to W.
PIPES = [("pipe=2,expert=2,data=2", "interleaved", 4, 3, 8),
         ("pipe=2,expert=2,data=2", "zb-h1", 4, 1, 8),
         ("pipe=3,expert=2", "1f1b", 4, 1, 6),
         ("pipe=2,expert=2,tensor=2", "gpipe", 2, 3, 8)]
PIPE_CASES = PIPES if FULL else PIPES[:1]


def _job(corpus, mesh, stage, **extra):
    fields = dict(model="moe-tiny", mesh=mesh, zero_stage=stage, precision="fp32",
                  batch_size=16, seq_len=32, router_z_loss_coef=1e-3)
    return make_job(corpus, **{**fields, **extra})


def _train(job, corpus):
    """Ten steps: each step's metrics, and the final parameters in saved form."""
    step_fn = compile_step(job)
    state = initial_state(job)
    t = job.run.train
    records = []
    for i in range(t.steps):
        batch = corpus_lib.global_batch(corpus, "train", job.run.data.seq_len, t.batch_size,
                                      t.seed, step=i, sharding=job.state_plan.batch_sharding)
        state, metrics = step_fn(state, batch)
        records.append({k: np.asarray(metrics[k]) for k in
                        ("loss", "aux_loss", "z_loss", "expert_load") if k in metrics})
    stacked = {k: np.stack([r[k] for r in records]) for k in records[0]}
    return stacked, host(job.state_plan.saved_form(state).params)


@pytest.fixture(scope="module")
def reference(corpus):
    return _train(_job(corpus, "fsdp=1", 0, devices=jax.devices()[:1]), corpus)


def test_presets_have_the_published_parameter_counts():
    """Mixtral-8x7B and Qwen3-30B-A3B, counted from the arrays' abstract
    shapes as memory_report.py counts them; and the parameters a token
    computes with (12.9B and 3.3B, as published)."""
    published = {"mixtral-8x7b": (46_702_792_704, 12_879_925_248),
                 "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704)}
    for name, (count, active) in published.items():
        cfg = models.config(name, 256)
        assert (cfg.param_count, cfg.active_param_count) == (count, active)
        shapes = jax.eval_shape(models.model_fns(cfg).init, jax.random.key(0))
        assert sum(int(np.prod(x.value.shape)) for x in jax.tree.leaves(
            shapes, is_leaf=lambda x: hasattr(x, "value"))) == count
    tiny, llama = models.config("moe-tiny", 256), models.config("llama-tiny", 256)
    # moe-tiny computes with llama-tiny's parameters per token, plus the routers.
    assert tiny.active_param_count - llama.param_count == tiny.n_layer * tiny.d_model * 8
    shared = models.config("moe-tiny", 256, n_shared_experts=1)
    shapes = jax.eval_shape(models.model_fns(shared).init, jax.random.key(0))
    extra = 3 * shared.d_model * shared.d_mlp * shared.n_layer  # one always-on expert a layer
    assert shared.param_count == tiny.param_count + extra == sum(
        int(np.prod(x.value.shape)) for x in jax.tree.leaves(
            shapes, is_leaf=lambda x: hasattr(x, "value")))
    assert shared.active_param_count == tiny.active_param_count + extra


def _reference_moe(x, logits, w_gate, w_up, w_down, k, normalise, capacity=None):
    """Each token through its top-k experts one by one (numpy), as Hugging
    Face's Mixtral block computes it; with `capacity`, an expert takes the
    first `capacity` copies in the order choice, then position."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, top, -1)
    if normalise:
        weights /= weights.sum(-1, keepdims=True)
    taken = np.zeros(logits.shape[1], int)
    keep = np.ones_like(top, bool)
    if capacity is not None:
        for j in range(k):
            for n in range(len(x)):
                e = top[n, j]
                keep[n, j] = taken[e] < capacity
                taken[e] += 1
    silu = lambda a: a / (1 + np.exp(-a))
    out = np.zeros_like(x)
    for n in range(len(x)):
        for j in range(k):
            e = top[n, j]
            if keep[n, j]:
                h = silu(x[n] @ w_gate[e]) * (x[n] @ w_up[e])
                out[n] += weights[n, j] * (h @ w_down[e])
    return out


@pytest.mark.parametrize("normalise", [True, False])
def test_dispatch_matches_each_token_through_its_experts(normalise):
    """Dropless (sorted copies, either grouped GEMM) and capped dispatch on one
    device against the per-token reference: with room for every copy, and
    with a capacity that drops some."""
    rng = np.random.default_rng(0)
    N, D, F, E, k = 24, 8, 6, 4, 2
    x = rng.normal(size=(N, D)).astype(np.float32)
    logits = rng.normal(size=(N, E)).astype(np.float32)
    w = [rng.normal(size=s).astype(np.float32) * 0.3 for s in ((E, D, F), (E, D, F), (E, F, D))]
    routing = moe.route(jnp.asarray(logits), k, normalise)
    expect = _reference_moe(x, logits, *w, k, normalise)
    for gemm in grouped.GEMMS:
        np.testing.assert_allclose(moe.dropless(x, routing, *w, E, None, 1, moe.Kernels(gemm)),
                                   expect, rtol=1e-5, atol=1e-5, err_msg=gemm)
    np.testing.assert_allclose(moe.capped(x, routing, *w, E, None, 1, float(E)), expect,
                               rtol=1e-5, atol=1e-5)
    factor = 0.5  # capacity 6 of 12 copies per expert on average: some dropped
    cap = moe.capacity(N, k, E, factor)
    dropped = _reference_moe(x, logits, *w, k, normalise, capacity=cap)
    assert not np.allclose(dropped, expect)
    np.testing.assert_allclose(moe.capped(x, routing, *w, E, None, 1, factor), dropped,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh,stage,extra", CASES,
                         ids=[f"{m}-zero{s}{'-capacity' if e else ''}" for m, s, e in CASES])
def test_ten_steps_match_one_device(corpus, reference, mesh, stage, extra):
    """Losses, router losses, expert loads and parameters after ten steps on
    an expert-parallel layout equal one device's (dropless)."""
    ref, ref_params = reference
    got, params = _train(_job(corpus, mesh, stage, **extra), corpus)
    assert got["loss"][-1] < got["loss"][0] - 0.3, "the loss should fall over ten steps"
    for key in ("loss", "aux_loss", "z_loss", "expert_load"):
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, err_msg=key)
    assert_close(params, ref_params, RTOL)


def test_bf16_trains_with_experts_and_tensor_split(corpus, reference):
    """bf16 compute on expert=2,fsdp=2,tensor=2 at ZeRO-3: the dispatch's
    gradient sums over the data and tensor axes compile on CPU (Hooks.local
    runs them in float32) and three steps follow float32's to bf16's
    precision."""
    ref, _ = reference
    job = _job(corpus, "expert=2,fsdp=2,tensor=2", 3, precision="bf16", steps=3)
    got, _ = _train(job, corpus)
    np.testing.assert_allclose(got["loss"], ref["loss"][:3], rtol=2e-2)


@pytest.mark.skipif(not FULL, reason="ZERO_JAX_FULL_GRID=1: shared experts")
def test_shared_experts_match_one_device(corpus):
    ref, ref_params = _train(_job(corpus, "fsdp=1", 0, devices=jax.devices()[:1], **SHARED),
                             corpus)
    got, params = _train(_job(corpus, "expert=2,fsdp=2,tensor=2", 3, **SHARED), corpus)
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=RTOL)
    assert_close(params, ref_params, RTOL)


@pytest.mark.parametrize("mesh,schedule,m,stage,devices", PIPE_CASES,
                         ids=[f"{c[1]}-{c[0]}-zero{c[3]}" for c in PIPE_CASES])
def test_pipelined_experts_with_router_losses_match_one_device(corpus, reference, mesh,
                                                               schedule, m, stage, devices):
    """Each stage's part of the router losses is in its backward and its
    metrics leave the pipeline: ten steps' losses, router losses, per-layer
    expert loads and parameters equal one device's. (Without the term in
    the backward, aux_loss is 18% off at step ten.)"""
    ref, ref_params = reference
    got, params = _train(_job(corpus, mesh, stage, pipeline_schedule=schedule, microbatches=m,
                              devices=jax.devices()[:devices]), corpus)
    for key in ("loss", "aux_loss", "z_loss", "expert_load"):
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, err_msg=key)
    assert_close(params, ref_params, RTOL)


def test_expert_parallel_step_exchanges_tokens_not_experts(corpus):
    """On expert=4,data=2 the step moves tokens to their experts with
    all-to-alls over `expert`: per layer, forward, the token copies there
    and back and their expert ids, backward, the copies' gradients there
    and back; payload bytes (step) equal that count (and a few bytes of
    offsets). The experts' weights
    are never gathered over `expert`, only over `data` (ZeRO-1's update)."""
    job = _job(corpus, "expert=4,data=2", 1)
    mesh, cfg = job.state_plan.mesh, job.model.config
    text = hlo.partitioned_text(job.lower_train_step())
    ep, k, D = 4, cfg.n_experts_per_tok, cfg.d_model
    copies = job.run.train.batch_size * job.run.data.seq_len // 8 * k  # per device
    per_layer = 4 * ep * copies * D * 4 + ep * copies * 4  # four f32 exchanges, one of int32 ids
    measured = traffic.traffic(text, mesh)
    assert measured.by_op["all-to-all@expert"] == pytest.approx(cfg.n_layer * per_layer, rel=0.05)
    L, E, F = cfg.n_layer, cfg.n_experts, cfg.d_mlp
    local = {(L, E // ep, D, F), (L, E // ep, F, D)}  # this device's experts, gathered by ZeRO
    gathered = [c for c in hlo.collectives(text) if c.op == "all-gather"]
    over_expert = [c for c in gathered if "expert" in (c.axes(mesh) or ())]
    assert not [c for c in over_expert if c.shape in local | {(L, E, D, F), (L, E, F, D)}]
    assert {c.shape for c in gathered if c.axes(mesh) == ("data",)} >= local


def test_experts_are_sharded_over_the_other_data_axes(corpus):
    """ZeRO-3 on expert=2,fsdp=4: an expert's weights split over `expert`
    (the experts) and `fsdp` (ZeRO), the dense weights over both as data."""
    specs = _job(corpus, "expert=2,fsdp=4", 3).state_plan.specs.params["blocks"]
    gate = tuple(specs["moe"]["w_experts_gate"])
    assert gate[1] == "expert" and "fsdp" in gate and gate.count("expert") == 1
    assert any(e == ("fsdp", "expert") for e in specs["w_q"])


@pytest.mark.parametrize("fields,message", [
    (dict(model="llama-tiny", mesh="expert=2,fsdp=4"), "expert=2 on a dense model"),
    (dict(mesh="expert=8", n_experts=4, n_experts_per_tok=2),
     "4 experts do not split over expert=8"),
    (dict(n_experts_per_tok=9), "n_experts_per_tok=9 with n_experts=8"),
    (dict(grad_reduce="step"), "--grad-reduce step with a mixture of experts"),
])
def test_bad_input_is_one_line_before_compiling(corpus, fields, message):
    with pytest.raises((config_lib.ConfigError, ValueError), match=message):
        make_job(corpus, **{"model": "moe-tiny", "mesh": "expert=4,data=2", **fields})
