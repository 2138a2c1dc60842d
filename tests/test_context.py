"""Context parallelism (zero_jax/context): the balanced layout, ring
attention against one device's attention, ten steps of every strategy on
every layout against one device, the collectives of the compiled step
against their formula, and bad input.

CI runs llama-tiny at T = 128 with segment ids and a sliding window, one
strategy per layout; ZERO_JAX_FULL_GRID=1 runs llama-tiny and gpt-tiny at
T = 1024, every strategy on every layout, with segment ids and with a
sliding window, and pipelines.
"""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from models.common import layers
from tests.helpers import assert_close, compile_step, host, initial_state, make_job
from zero_jax import config as config_lib
from zero_jax.analysis import hlo, traffic
from zero_jax.context import order as context_order, ring, split
from zero_jax.data import corpus as corpus_lib

FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
RTOL = 1e-5
STRATEGIES = ("all-gather", "ring", "ulysses")
MESHES = ("context=4,data=2", "context=2,fsdp=2,tensor=2", "context=2,fsdp=4")
# (model, extra fields): plain, documents packed, Mistral's window.
VARIANTS = {"llama": ("llama-tiny", {}), "gpt": ("gpt-tiny", {}),
            "llama-segments": ("llama-tiny", {"segment_ids": True}),
            "llama-window": ("llama-tiny", {"sliding_window": 300})}
T_FULL = 1024
if FULL:
    CASES = ([(v, m, s) for v in ("llama", "gpt") for m, s in itertools.product(MESHES, STRATEGIES)]
             + [(v, "context=4,data=2", s) for v in ("llama-segments", "llama-window")
                for s in STRATEGIES])
else:
    CASES = [("ci", m, s) for m, s in zip(MESHES, ("ring", "ulysses", "all-gather"))]


def _job(corpus, variant, **fields):
    if variant == "ci":  # both masks at once, at a shorter length
        model, extra, T = "llama-tiny", {"segment_ids": True, "sliding_window": 40}, 128
    else:
        (model, extra), T = VARIANTS[variant], T_FULL
    base = dict(model=model, precision="fp32", batch_size=4, seq_len=T, max_seq_len=T,
                zero_stage=3, **extra)
    return make_job(corpus, **{**base, **fields})


def _train(job, corpus):
    """Ten steps: the losses, and the final parameters in saved form."""
    step_fn = compile_step(job)
    state = initial_state(job)
    t, d = job.run.train, job.run.data
    losses = []
    for i in range(t.steps):
        batch = corpus_lib.global_batch(corpus, "train", d.seq_len, t.batch_size, t.seed, step=i,
                                      sharding=job.state_plan.batch_sharding, segments=d.segment_ids)
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), host(job.state_plan.saved_form(state).params)


_REFERENCES: dict = {}


def _reference(corpus, variant):
    if variant not in _REFERENCES:
        _REFERENCES[variant] = _train(_job(corpus, variant, mesh="fsdp=1", zero_stage=0,
                                           devices=jax.devices()[:1]), corpus)
    return _REFERENCES[variant]


def test_the_balanced_layout_gives_each_device_equal_causal_work():
    """Device i holds chunks i and 2c - 1 - i; under a causal mask each
    device's queries see the same number of keys; positions restart at each
    document in the laid-out order as in the natural one."""
    T, c = 32, 4
    order = context_order.zigzag(T, c)
    assert sorted(order) == list(range(T))
    blocks = order.reshape(c, T // c)
    assert list(blocks[1]) == list(range(4, 8)) + list(range(24, 28))
    work = (blocks + 1).sum(axis=1)  # keys each device's queries see
    assert len(set(work)) == 1
    segments = np.repeat(np.arange(4), [5, 9, 11, 7])[None]
    natural = layers.positions(jnp.asarray(segments))
    laid_out = context_order.positions(order, T, context_order.arrange(jnp.asarray(segments), order))
    np.testing.assert_array_equal(laid_out, context_order.arrange(natural, order))
    with pytest.raises(ValueError, match="does not split into 2 x context = 8"):
        context_order.zigzag(36, 4)


@pytest.mark.parametrize("window,segments,kv_heads", [(0, False, 4), (0, True, 2), (24, True, 2)])
def test_ring_attention_matches_one_device_in_value_and_gradients(window, segments, kv_heads):
    """The ring over context=4 (K/V blocks passed four times round, the
    masked half-blocks skipped) against the one-device attention on the
    natural order, grouped heads, documents and a window included."""
    c, B, T, H, Q = 4, 2, 64, 4, 8
    mesh = jax.make_mesh((c,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:c])
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, Q))
    k, v = (jax.random.normal(kk, (B, T, kv_heads, Q)) for kk in keys[1:3])
    seg = jnp.asarray(np.sort(np.random.RandomState(0).randint(0, 3, (B, T)), axis=1), jnp.int32)
    seg = seg if segments else None
    order = context_order.zigzag(T, c)
    back = jnp.asarray(np.argsort(order))
    spec = PartitionSpec(None, "context")

    def one_device(q, k, v):
        return layers.attention(q, k, v, "xla", window, segments_BxT=seg)

    def over_ring(q, k, v):
        args = [context_order.arrange(x, order) for x in (q, k, v)]

        def body(q, k, v, *s):
            return ring.attention(q, k, v, order, s[0] if s else None, axis="context", size=c,
                                  window=window)
        extra = [context_order.arrange(seg, order)] if seg is not None else []
        out = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (3 + len(extra)),
                            out_specs=spec)(*args, *extra)
        return jnp.take(out, back, axis=1)

    w = jax.random.normal(keys[3], q.shape)
    for f in (lambda fn: fn, lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a) * w), (0, 1, 2))):
        want, got = f(one_device)(q, k, v), jax.jit(f(over_ring))(q, k, v)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("variant,mesh,strategy", CASES, ids=["-".join(c) for c in CASES])
def test_ten_steps_match_one_device(corpus, variant, mesh, strategy):
    """Losses and parameters after ten steps at ZeRO-3 equal one device's."""
    ref_losses, ref_params = _reference(corpus, variant)
    losses, params = _train(_job(corpus, variant, mesh=mesh, context_attention=strategy), corpus)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_close(params, ref_params, RTOL)


PIPES = [("pipe=2,context=2,fsdp=2", "all-gather", 1), ("pipe=2,context=2,data=2", "ulysses", 3)]


@pytest.mark.skipif(not FULL, reason="ZERO_JAX_FULL_GRID=1: context inside pipeline stages")
@pytest.mark.parametrize("mesh,strategy,stage", PIPES, ids=[p[1] for p in PIPES])
def test_pipelined_context_matches_one_device(corpus, mesh, strategy, stage):
    """Inside 1f1b stages (T = 128: a pipeline's ticks run whole stages)."""
    fields = dict(microbatches=2, pipeline_schedule="1f1b", seq_len=128, max_seq_len=128)
    ref_losses, ref_params = _train(_job(corpus, "llama", mesh="fsdp=1", zero_stage=0,
                                         devices=jax.devices()[:1], **fields), corpus)
    losses, params = _train(_job(corpus, "llama", mesh=mesh, zero_stage=stage,
                                 context_attention=strategy, **fields), corpus)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_close(params, ref_params, RTOL)


def test_context_8_moves_blocks_not_sequences(corpus):
    """On context=8 (llama-tiny, batch 2 x 256, ZeRO-3): ring gathers no K
    or V over `context` and permutes, per layer, K and V c - 1 times
    forward, again backward with dK and dV c times (home included); Ulysses
    all-to-alls q, k, v (the 4 kv heads repeated to 8, which 8 divides) and
    the output each way, forward and backward. Payload bytes per step equal
    those counts."""
    B, T, c = 2, 256, 8
    got = {}
    for strategy in ("ring", "ulysses"):
        job = make_job(corpus, model="llama-tiny", precision="fp32", batch_size=B, seq_len=T,
                       mesh="context=8", zero_stage=3, context_attention=strategy)
        text = hlo.partitioned_text(job.lower_train_step())
        got[strategy] = (traffic.traffic(text, job.state_plan.mesh).by_op, hlo.collectives(text),
                         job.state_plan.mesh)
    cfg = job.model.config
    L, H, K, Q = cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.q_dim
    block = B * (T // c) * K * Q * 4  # one device's K (or V), float32
    by_op, collectives, mesh = got["ring"]
    kv = {(B, T, K, Q), (B, T // c, K, Q)}
    assert not [x for x in collectives if x.op == "all-gather" and x.shape in kv]
    ring_bytes = L * (2 * (c - 1) + 2 * (c - 1) + 2 * c) * block
    assert by_op["collective-permute@context"] == pytest.approx(ring_bytes, rel=0.05)
    assert "all-to-all@context" not in by_op
    by_op, _, _ = got["ulysses"]
    heads = B * (T // c) * H * Q * 4  # one device's q (or repeated k, v, or output)
    assert by_op["all-to-all@context"] == pytest.approx(L * 8 * heads, rel=0.05)
    assert "collective-permute@context" not in by_op


def test_auto_takes_ulysses_only_where_attention_keeps_no_scores(corpus):
    """Under XLA's attention Ulysses holds a whole sequence's scores for its
    heads (the memory table in docs/context.md): auto takes ring there, and
    all-gather inside a pipeline; Ulysses under cuDNN where the heads split."""
    assert split.choose("auto", 8, 1, 8, False, "cudnn") == "ulysses"
    assert split.choose("auto", 8, 1, 8, False, "xla") == "ring"
    assert split.choose("auto", 8, 2, 8, False, "cudnn") == "ring"  # 4 heads per device
    assert split.choose("auto", 8, 1, 8, True, "xla") == "all-gather"
    assert split.choose("ulysses", 8, 1, 8, False, "xla") == "ulysses"  # asked for
    job = make_job(corpus, model="llama-tiny", mesh="context=8", seq_len=128)
    assert job.hooks.context.strategy == "ring"  # on this CPU: XLA's attention


@pytest.mark.parametrize("fields,message", [
    (dict(seq_len=100), "--seq-len 100 with context=4: the balanced layout cuts each sequence "
                        "into 2 x context = 8 chunks"),
    (dict(mesh="context=8", context_attention="ulysses", n_head=4, n_kv_head=4),
     "ulysses with 4 heads on tensor=1, context=8"),
    (dict(seq_len=512), "--seq-len 512 exceeds the model's 256 positions"),
    (dict(grad_reduce="step"), "--grad-reduce step with context=4"),
    (dict(mesh="pipe=2,context=2,fsdp=2", context_attention="ring", microbatches=2),
     "--context-attention ring with pipe=2"),
])
def test_bad_input_is_one_line_before_compiling(corpus, fields, message):
    with pytest.raises((config_lib.ConfigError, ValueError), match=message):
        make_job(corpus, **{"model": "llama-tiny", "mesh": "context=4,data=2", "seq_len": 128,
                            **fields})
