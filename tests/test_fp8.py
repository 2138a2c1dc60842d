"""FP8 products: the rounding by hand, the error within what e4m3 and e5m2
allow on random and heavy-tailed inputs, the weight gathered in 8 bits at
ZeRO-3, and the combinations refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.model import fp8, param_use

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
    use = param_use.Use(None, None, jnp.bfloat16, jnp.float32, jnp.float32, None, fp8=True)
    x, w, g = _inputs(kind, jax.random.key(1))
    y, vjp = jax.vjp(lambda x, w: param_use.dense(use, "td,df->tf", x, w), x, w)
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
