"""ZeRO++'s int8 collectives: the blocks a row splits into, the rounding
within half a step of each block, qwZ's gather (each device's shard
quantized where it is stored, all-gathered as int8 in the compiled
program), the bytes qwZ, qgZ and FP8 move against bf16's and the formula,
and training with them against full precision."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.helpers import make_job, train
from zero_jax import config as config_lib
from zero_jax.sharding import quantized
from zero_jax.sharding.quantized import Blocks


def test_a_row_splits_into_whole_blocks_of_about_the_size_asked():
    assert quantized.blocks(1024, 256) == Blocks(256, 1024)
    assert quantized.blocks(576, 256) == Blocks(192, 576)  # the largest divisor down to 128
    assert quantized.blocks(24, 256) == Blocks(24, 24)  # shorter than a block: the row
    assert quantized.blocks(257, 256) == Blocks(256, 512)  # a prime: padded
    # A byte per element and 4 per block's scale: 1/64 more than a byte for blocks of 256.
    assert quantized.wire_bytes(4096, 1024, 256) == 4096 + 4 * 16


@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_each_value_is_within_half_a_step_of_its_block(kind):
    key = jax.random.key(0)
    x = jax.random.normal(key, (32, 200)) if kind == "normal" else jax.random.t(key, 2.0, (32, 200))
    q, scale = quantized.quantize(x, 64)
    assert q.dtype == jnp.int8 and q.shape == (32, 4, 50) and scale.shape == (32, 4, 1)
    y = quantized.dequantize(q, scale, 200, jnp.float32)
    step = np.repeat(np.asarray(scale)[..., 0], 50, axis=-1)  # amax / 127 per element's block
    assert np.all(np.abs(np.asarray(y) - np.asarray(x)) <= step / 2 * (1 + 1e-6))
    # The largest magnitude of each block is exact, up to float32 rounding of its scale.
    np.testing.assert_allclose(np.abs(np.asarray(y)).reshape(32, 4, 50).max(-1),
                               np.abs(np.asarray(x)).reshape(32, 4, 50).max(-1), rtol=1e-6)


def _reference(w, n, dim, block):
    """Each of the n shards along `dim` quantized by itself, rows merged."""
    shards = np.split(np.asarray(w), n, axis=dim)
    out = []
    for s in shards:
        q, scale = quantized.quantize(jnp.asarray(s).reshape(1, -1), block)
        out.append(np.asarray(quantized.dequantize(q, scale, s.size, jnp.float32)).reshape(s.shape))
    return np.concatenate(out, axis=dim)


@pytest.mark.parametrize("shape,stored,compute,dim,tdim", [
    ((64, 48), P(None, "fsdp"), P(), 1, None),
    ((64, 48), P("fsdp", "tensor"), P(None, "tensor"), 0, 1),
    ((8, 3, 4, 12), P("fsdp", None, "tensor", None), P(None, None, "tensor", None), 0, 2),
], ids=["fsdp-on-dim1", "fsdp-and-tensor", "4d-tensor-inside"])
def test_qwz_gathers_int8_and_dequantizes_each_shard(shape, stored, compute, dim, tdim):
    """Shards quantized where they are stored: the gathered copy is each
    shard's own blocks dequantized; the compiled all-gathers are s8 and f32
    (the scales), none in the parameter's dtype."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
    w = jax.random.normal(jax.random.key(3), shape, jnp.float32)
    gather = jax.jit(lambda w: quantized.gather(w, NamedSharding(mesh, stored),
                                                NamedSharding(mesh, compute), 16, jnp.float32),
                     in_shardings=NamedSharding(mesh, stored))
    y = gather(w)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, compute), len(shape))
    if tdim is None:
        expected = _reference(w, 4, dim, 16)
    else:  # each device's part is one row of blocks
        expected = np.concatenate([_reference(part, 4, dim, 16)
                                   for part in np.split(np.asarray(w), 2, axis=tdim)], axis=tdim)
    # To float32 rounding: XLA may divide by a scale as a multiply by its reciprocal.
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-6)
    text = gather.lower(w).compile().as_text()
    gathers = [line for line in text.splitlines() if "all-gather(" in line or "all-gather-start(" in line]
    assert any("s8[" in line for line in gathers), gathers
    assert not any(line.split("=")[1].strip().startswith(f"f32[{shape[0]}") for line in gathers)


# bf16 compute, float32 gradients, on fsdp=8 at ZeRO-3 (tests/test_traffic.py's setting).
BF16 = dict(precision="bf16", batch_size=32, seq_len=32, max_seq_len=32)
QUANTIZED = {"qwZ": dict(zero_quantized_weights=True), "qgZ": dict(zero_quantized_grads=True),
             "both": dict(zero_quantized_weights=True, zero_quantized_grads=True),
             "fp8": dict(precision="fp8"),
             "fp8-delayed-both": dict(precision="fp8", fp8="delayed", zero_quantized_weights=True,
                                      zero_quantized_grads=True)}


@pytest.fixture(scope="module")
def collectives(corpus):
    """name -> the compiled step's collectives, measured and in theory."""
    out = {}
    for name, flags in {"bf16": {}, **QUANTIZED}.items():
        job = make_job(corpus, **{**BF16, **flags})
        out[name] = job.collectives(job.compile_with_text()[1])
    return out


def _reduction(traffic):
    return traffic.of("reduce-scatter") + traffic.of("all-to-all")


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_collectives_move_about_half_and_match_their_formula(collectives, name):
    """qwZ's gathers and qgZ's reductions move at most 0.55x bf16's bytes in
    the compiled step (a byte per element and a float32 scale per 256; the
    gradients were float32, so qgZ's are about 0.27x), FP8's gathers a byte
    per element; each within 1% of traffic.theory's formula."""
    base, got = collectives["bf16"], collectives[name]
    total = sum(got.theory.values())
    assert got.measured.total == pytest.approx(total, rel=0.01), (got.measured.by_op, got.theory)
    gathers = got.measured.of("all-gather") / base.measured.of("all-gather")
    reductions = _reduction(got.measured) / _reduction(base.measured)
    print(f"{name}: all-gather {gathers:.3f}x, gradient reduction {reductions:.3f}x of bf16's")
    flags = QUANTIZED[name]
    if flags.get("zero_quantized_weights") or flags.get("precision") == "fp8":
        assert gathers <= 0.55
    if flags.get("zero_quantized_grads"):
        assert reductions <= 0.55 and got.measured.of("all-to-all") > 0
    else:
        assert reductions == 1


@pytest.mark.parametrize("overrides", [
    dict(mesh="fsdp=8"),
    dict(mesh="data=2,fsdp=4"),
    dict(mesh="fsdp=4,tensor=2", layout="fsdp_tp"),
], ids=["fsdp8", "hybrid", "tensor2"])
def test_quantized_steps_track_the_unquantized_ones(corpus, overrides):
    """qwZ and qgZ together: 3 steps' losses within 1e-3 of full precision's."""
    flags = dict(steps=3, **overrides)
    base, _ = train(make_job(corpus, **flags), corpus)
    quant, _ = train(make_job(corpus, zero_quantized_weights=True, zero_quantized_grads=True,
                              **flags), corpus)
    np.testing.assert_allclose(quant, base, rtol=1e-3)


@pytest.mark.parametrize("flag", ["zero_quantized_weights", "zero_quantized_grads"])
def test_quantized_collectives_below_stage_3_are_refused(corpus, flag):
    with pytest.raises(config_lib.ConfigError, match=f"--{flag.replace('_', '-')} with --zero-stage 1"):
        make_job(corpus, zero_stage=1, **{flag: True})


@pytest.mark.parametrize("flags,says", [
    (dict(mesh="pipe=2,fsdp=4", microbatches=2), "with a pipeline"),
    (dict(microbatches=2, grad_reduce="step"), "with --grad-reduce step"),
    (dict(mesh="fsdp=4,context=2", seq_len=64), "with ZeRO over context"),
], ids=["pipe", "grad-reduce-step", "context"])
def test_qgz_where_it_would_not_quantize_is_refused(corpus, flags, says):
    """qgZ reduces each device's own rows' partial sums inside the backward
    pass: where gradients are reduced elsewhere, or ZeRO shards over an axis
    the batch does not split, it is refused, not silently skipped."""
    with pytest.raises(config_lib.ConfigError, match=f"--zero-quantized-grads {says}"):
        make_job(corpus, zero_quantized_grads=True, **flags)
    make_job(corpus, zero_quantized_weights=True, **flags)  # qwZ has no such limit


# Every mesh axis, accumulation, remat and offload with FP8 and ZeRO++ together: two
# steps each, against the same layout without them. CI runs the first three.
Q = dict(zero_quantized_weights=True, zero_quantized_grads=True)
COMBINATIONS = {
    "tensor": dict(mesh="fsdp=4,tensor=2", layout="fsdp_tp", precision="fp8", **Q),
    "context-delayed": dict(mesh="fsdp=4,context=2", seq_len=64, precision="fp8", fp8="delayed",
                            zero_quantized_weights=True),
    "pipe-qwz-delayed": dict(mesh="pipe=2,fsdp=4", microbatches=2, precision="fp8", fp8="delayed",
                             zero_quantized_weights=True),
    "offload": dict(precision="fp8", offload_optimizer=True, offload_params=True, **Q),
    "remat-accumulated": dict(precision="fp8", fp8="delayed", remat="full", microbatches=2, **Q),
    "experts": dict(model="moe-tiny", mesh="expert=2,fsdp=4", precision="fp8", **Q),
    "data-fsdp": dict(mesh="data=2,fsdp=4", precision="fp8", **Q),
}
FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))


@pytest.mark.parametrize("name", list(COMBINATIONS) if FULL else list(COMBINATIONS)[:3])
def test_fp8_and_zero_plus_plus_compose_with_the_layouts(corpus, name):
    flags = COMBINATIONS[name]
    plain = {k: v for k, v in flags.items()
             if k not in ("fp8", "zero_quantized_weights", "zero_quantized_grads")}
    plain["precision"] = "bf16"
    base, _ = train(make_job(corpus, steps=2, **plain), corpus)
    got, _ = train(make_job(corpus, steps=2, **flags), corpus)
    np.testing.assert_allclose(got, base, rtol=0.02)
