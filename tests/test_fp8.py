"""FP8 products: the rounding by hand, the error within what e4m3 and e5m2
allow on random and heavy-tailed inputs, the weight gathered in 8 bits at
ZeRO-3, the combinations refused, and delayed scaling's amax histories:
advanced each step, combined by max over a step's parts, checkpointed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import compile_step, host, make_job, train
from zero_jax import config as config_lib, job as job_lib, run as run_lib
from zero_jax.analysis import hlo
from zero_jax.checkpoint import manager as manager_lib
from zero_jax.data import corpus as corpus_lib
from zero_jax.model import fp8, fp8_dense, param_use

ROOT = Path(__file__).resolve().parent.parent

# Half an ulp, relative, for normal numbers: e4m3 has 3 mantissa bits, e5m2 2; each
# rounded operand is widened to bf16 with its bf16 scale (half a bf16 ulp twice).
E4M3_STEP = 2.0 ** -4 + 2.0 ** -8
E5M2_STEP = 2.0 ** -3 + 2.0 ** -8


def test_rounding_by_hand():
    # Current scaling puts the largest magnitude on the format's largest value.
    x = jnp.array([0.0, 1.0, -3.0, 6.0], jnp.float32)
    q, scale = fp8.current(x, fp8.E4M3)
    assert float(scale) == np.float32(6.0) / np.float32(448)
    # 1 / scale = 74.67 lies between e4m3's neighbours 72 and 80 (3 mantissa bits: steps of 8
    # from 64 to 128) and rounds to 72; -3 and 6 land exactly on -224 and 448.
    assert np.asarray(q.astype(jnp.float32)).tolist() == [0.0, 72.0, -224.0, 448.0]
    assert float(fp8.scale_for(jnp.float32(0), fp8.E4M3)) == 1.0  # nothing to scale
    assert float(fp8.scale_for(jnp.float32(jnp.inf), fp8.E5M2)) == 1.0
    # Beyond the range, clipped (a delayed scale can lag a growing tensor).
    assert float(fp8.quantize(jnp.float32(1e6), fp8.E4M3, jnp.float32(1)).astype(jnp.float32)) == 448


def _inputs(kind: str, key):
    k1, k2, k3 = jax.random.split(key, 3)
    if kind == "normal":
        draw = jax.random.normal
    else:  # heavy tails: Student's t with 2 degrees of freedom, outliers 100x the bulk
        draw = lambda k, s: jax.random.t(k, 2.0, s)  # noqa: E731
    x = draw(k1, (64, 256)).astype(jnp.bfloat16)
    w = draw(k2, (256, 96)) * 0.05
    g = draw(k3, (64, 96)).astype(jnp.bfloat16)
    return x, w, g


@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_an_fp8_product_is_its_rounded_operands_product(kind):
    """The FP8 dense and its two backward products against float32: each is
    exactly the product of the operands rounded to e4m3 (e5m2 for the
    output gradient), and its error from float32 within the rounding's
    bound, sum |x| |w| (2 x half an ulp + their product), plus what values
    below the smallest normal lose (an absolute half-ulp there)."""
    use = param_use.Use(None, None, jnp.bfloat16, jnp.float32, jnp.float32, None)
    x, w, g = _inputs(kind, jax.random.key(1))
    y, vjp = jax.vjp(lambda x, w: fp8_dense.dense(use, "td,df->tf", x, w, None), x, w)
    dx, dw = vjp(g)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    # As the product sees them: rounded at their scales, widened to the compute dtype.
    xr = f32(fp8.rounded(x, fp8.E4M3))
    wr = f32(fp8.dequantize(*fp8.current(w, fp8.E4M3), jnp.bfloat16))
    gr = f32(fp8.rounded(g, fp8.E5M2))
    np.testing.assert_allclose(f32(y), xr @ wr, rtol=2 ** -7, atol=1e-6)  # bf16 output rounding
    np.testing.assert_allclose(f32(dx), gr @ wr.T, rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(dw, xr.T @ gr, rtol=1e-5, atol=1e-5)
    xf, wf, gf = f32(x), w, f32(g)

    def bound(a, b, ea, eb, sa, sb):
        tiny = lambda s, dt: s * float(jnp.finfo(dt).smallest_subnormal) / 2  # noqa: E731
        rel = jnp.abs(a) @ jnp.abs(b) * (ea + eb + ea * eb)
        return rel + tiny(sa, fp8.E4M3) * jnp.abs(b).sum(0) + tiny(sb, fp8.E4M3) * jnp.abs(a).sum(1)[:, None]

    sx, sw = (fp8.scale_for(jnp.max(jnp.abs(a)), fp8.E4M3) for a in (xf, wf))
    assert jnp.all(jnp.abs(f32(y) - xf @ wf) <= bound(xf, wf, E4M3_STEP, E4M3_STEP, sx, sw) * 1.01
                   + jnp.abs(xf @ wf) * 2 ** -8)
    sg = fp8.scale_for(jnp.max(jnp.abs(gf)), fp8.E5M2)
    assert jnp.all(jnp.abs(dw - xf.T @ gf) <= bound(xf.T, gf, E4M3_STEP, E5M2_STEP, sx, sg) * 1.01
                   + 1e-5)


def _job(flat, devices=8):
    run = config_lib.build(None, {"model.name": "gpt-tiny", "model.vocab_size": 256,
                                  "data.seq_len": 32, "train.batch_size": 16, **flat})
    return job_lib.prepare(run, models.for_run(run.model, 256)[0])


def test_zero_3_gathers_fp8_weights_in_8_bits():
    """On fsdp=8 at ZeRO-3 the compiled step all-gathers the blocks' weights
    as f8e4m3 (a byte each), and the head's in bf16."""
    job = _job({"parallel.mesh": "fsdp=8", "parallel.zero_stage": 3, "precision.policy": "fp8"})
    assert job.policy.fp8 and job.hooks.fp8
    text = job.compile_with_text()[1]
    gathers = [line for line in text.splitlines() if " all-gather(" in line or "all-gather-start(" in line]
    assert any("f8e4m3fn[" in line for line in gathers), gathers[:5]
    assert any("bf16[" in line for line in gathers)


def test_fp8_with_a_split_backward_is_refused_before_compiling():
    with pytest.raises(config_lib.ConfigError, match="--precision fp8 with --pipeline-schedule zb-h1"):
        _job({"parallel.mesh": "pipe=2,data=4", "precision.policy": "fp8",
              "parallel.pipeline_schedule": "zb-h1", "train.microbatches": 4})


def test_a_delayed_product_scales_from_its_history_and_reports_its_amaxes():
    """Delayed scaling rounds each operand at the scale of its history row's
    largest amax (clipping what outgrew it), and reports this use's three
    amaxes as the history's gradient, in column 0; an empty history scales
    currently."""
    use = param_use.Use(None, None, jnp.bfloat16, jnp.float32, jnp.float32, None)
    x, w, g = _inputs("normal", jax.random.key(2))
    history = jnp.zeros((fp8.ROWS, 4)).at[:, 2].set(jnp.array([2.0, 0.01, 100.0]))

    def product(history):
        return jax.vjp(lambda x, w, h: fp8_dense.dense(use, "td,df->tf", x, w, h),
                       x, w, history)

    y, vjp = product(history)
    dx, dw, report = vjp(g)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    at = lambda a, amax, dt: fp8.dequantize(fp8.quantize(a, dt, fp8.scale_for(jnp.float32(amax), dt)),  # noqa: E731
                                           fp8.scale_for(jnp.float32(amax), dt), a.dtype)
    xr, wr, gr = f32(at(x, 2.0, fp8.E4M3)), f32(at(w, 0.01, fp8.E4M3)), f32(at(g, 100.0, fp8.E5M2))
    assert float(jnp.max(jnp.abs(wr))) == pytest.approx(0.01, rel=2 ** -3)  # w outgrew 0.01: clipped
    # The bf16 product's own rounding, relative to the sum of its terms' magnitudes.
    assert jnp.all(jnp.abs(f32(y) - xr @ wr) <= 2 ** -7 * (jnp.abs(xr) @ jnp.abs(wr)) + 1e-6)
    np.testing.assert_allclose(dw, xr.T @ gr, rtol=1e-5, atol=1e-5)
    amaxes = [float(jnp.max(jnp.abs(f32(a)))) for a in (x, w, g)]
    np.testing.assert_array_equal(report[:, 0], np.float32(amaxes))
    assert not np.any(report[:, 1:])
    y0, _ = product(jnp.zeros_like(history))  # empty: current scaling
    np.testing.assert_array_equal(f32(y0), f32(fp8_dense.dense(use, "td,df->tf", x, w, None)))


def _histories(params):
    return {k: np.asarray(v) for k, v in params["blocks"].items() if fp8.is_history((jax.tree_util.DictKey(k),))}


DELAYED = {"precision": "fp8", "fp8": "delayed", "fp8_history": 4}


@pytest.fixture(scope="module")
def delayed_reference(corpus):
    """fsdp=8 ZeRO-3, delayed scaling, 2 steps: the histories after each."""
    job = make_job(corpus, steps=2, **DELAYED)
    _, one = train(job, corpus, steps=1)
    _, two = train(job, corpus, steps=2)
    return _histories(one.params), _histories(two.params)


def test_histories_advance_one_column_a_step_beside_the_optimizer(delayed_reference):
    one, two = delayed_reference
    assert set(one) == {f"{w}_fp8_history" for w in ("w_qkv", "w_o", "w_fc", "w_proj")}
    for name, h in one.items():
        assert h.shape == (4, fp8.ROWS, 4)  # (layers, x/w/output gradient, steps)
        assert np.all(h[..., 0] > 0) and not np.any(h[..., 1:]), name  # AdamW never moved them
        np.testing.assert_array_equal(two[name][..., 1], h[..., 0])  # shifted one column
        assert np.all(two[name][..., 0] > 0) and not np.any(two[name][..., 2:])


@pytest.mark.parametrize("overrides", [
    dict(microbatches=2),
    dict(mesh="data=8", zero_stage=1, microbatches=2, grad_reduce="step"),
    dict(mesh="pipe=2,fsdp=4", microbatches=2),
], ids=["fsdp8-accumulated", "data8-partial-sums", "pipe2"])
def test_a_steps_amaxes_are_the_max_over_its_parts(corpus, delayed_reference, overrides):
    """Where a step's gradients are sums over microbatches, batch shards or
    pipeline ticks, its amaxes are the largest over them (a sum would be
    about twice): the first step's histories as one batch's, to rounding
    (within 10%: on the first step each part rounds at its own scale, so the
    activations downstream differ by a few percent)."""
    job = make_job(corpus, steps=1, **DELAYED, **overrides)
    _, state = train(job, corpus, steps=1)
    got = _histories(job.state_plan.saved_form(state).params)
    for name, h in delayed_reference[0].items():
        np.testing.assert_allclose(got[name], h, rtol=0.1, err_msg=name)


def test_histories_survive_a_checkpoint_onto_another_mesh_bit_for_bit(corpus, tmp_path):
    """Saved on fsdp=8 at ZeRO-3, restored onto pipe=2,data=4 at ZeRO-1 (its
    stages' slots, float32 master weights) bit for bit; the resumed step
    shifts the restored histories on."""
    job = make_job(corpus, steps=2, **DELAYED)
    _, state = train(job, corpus, steps=2)
    saved = host(job.state_plan.saved_form(state))
    checkpointer = manager_lib.Checkpointer(
        manager_lib.CheckpointConfig(dir=str(tmp_path)), job.state_plan.names, writer=True)
    checkpointer.save(2, job.state_plan.saved_form(state), run_lib.checkpoint_meta(job, 2))
    checkpointer.wait()
    target = make_job(corpus, mesh="pipe=2,data=4", zero_stage=1, microbatches=2, **DELAYED)
    restored, _ = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp_path))).restore(
        2, target.state_plan.targets)
    jax.tree.map(np.testing.assert_array_equal, host(restored), saved)
    before = _histories(saved.params)
    assert before and all(np.any(h) for h in before.values())
    t = target.run.train
    batch = corpus_lib.global_batch(corpus, "train", target.run.data.seq_len, t.batch_size, t.seed,
                                    step=2, sharding=target.state_plan.batch_sharding)
    resumed, _ = compile_step(target)(target.state_plan.from_saved(restored), batch)
    after = _histories(target.state_plan.saved_form(resumed).params)
    for name, h in before.items():
        np.testing.assert_array_equal(after[name][..., 1:], h[..., :-1], err_msg=name)


def test_a_product_through_autodiff_rounds_as_the_custom_vjp_does():
    """fp8.product (a mixture's grouped GEMMs): the forward and both
    gradients of the FP8 dense's custom VJP, from autodiff alone."""
    use = param_use.Use(None, None, jnp.bfloat16, jnp.float32, jnp.float32, None)
    x, w, g = _inputs("heavy", jax.random.key(4))
    w = w.astype(jnp.bfloat16)
    ours = jax.vjp(lambda x, w: fp8.product(lambda a, b: jnp.einsum("td,df->tf", a, b))(x, w), x, w)
    theirs = jax.vjp(lambda x, w: fp8_dense.dense(use, "td,df->tf", x, w, None), x, w)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(ours[0]), f32(theirs[0]), rtol=2 ** -7, atol=1e-6)
    for a, b in zip(ours[1](g), theirs[1](g)):
        # The weight gradient: bf16 (autodiff) against float32 (the custom VJP's gradient dtype).
        np.testing.assert_allclose(f32(a), f32(b), rtol=2 ** -6, atol=1e-3 * float(jnp.max(jnp.abs(f32(b)))))


def test_gemms_are_counted_by_kind():
    text = "\n".join([
        '  %g.1 = (bf16[8,8]{1,0}, s8[4]{0}) custom-call(f8e4m3fn[8,16]{1,0} %a, f8e4m3fn[16,8]{0,1} %b),'
        ' custom_call_target="__cublas$lt$matmul$f8"',
        '  %g.2 = (bf16[8,8]{1,0}, s8[4]{0}) custom-call(bf16[8,16]{1,0} %a, bf16[16,8]{1,0} %b),'
        ' custom_call_target="__cublas$lt$matmul"',
        '  %d.3 = bf16[8,8]{1,0} dot(bf16[8,16]{1,0} %a, bf16[16,8]{1,0} %b), lhs_contracting_dims={1}',
        '  %d.4 = f32[8,8]{1,0} dot(f8e4m3fn[8,16]{1,0} %a, f8e5m2[16,8]{1,0} %b), lhs_contracting_dims={1}',
        '  %c.5 = bf16[8,8]{1,0} convert(f8e4m3fn[8,8]{1,0} %q)',
    ])
    assert hlo.gemms(text) == {"cublas_fp8": 1, "cublas_other": 1, "triton_gemm": 0,
                               "dot_fp8": 1, "dot": 1}


def test_the_fp8_check_runs_its_stand_in(tmp_path):
    """scripts/fp8_check.py --dry-run (what gpu_checks.sh runs without a GPU):
    both precisions compiled, counted and timed."""
    out = subprocess.run([sys.executable, "scripts/fp8_check.py", "--dry-run", "--steps", "1",
                          "--warmup", "0", "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout[out.stdout.index("["):])
    assert [r["case"] for r in results] == ["dry-d64/bf16", "dry-d64/fp8"]
    assert all(r["gemms"]["dot"] > 0 and r["tokens_per_s"] > 0 for r in results)
    assert results[1]["fp8_over_bf16"] > 0
