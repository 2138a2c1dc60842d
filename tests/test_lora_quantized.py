"""LoRA on a quantized frozen base (zero_jax/model/base_quant.py): codes
and scales within their rounding bound of the weights, stored at their
bytes, gathered at ZeRO-3 as they are stored, and adapters trained on
fsdp=8 as on one device.

CI runs nf4 on fsdp=8; ZERO_JAX_FULL_GRID=1 adds int8.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import lora_merge
from tests.helpers import host, make_job
from tests.test_lora import _hf_base, _train
from zero_jax import run
from zero_jax.analysis import memory
from zero_jax.checkpoint import weights
from zero_jax.model import base_quant

FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
KINDS = ["nf4", "int8"] if FULL else ["nf4"]
# The largest rounding error over a block's amax: int8 half a step; nf4
# half the widest gap between two of its levels.
BOUND = {"int8": 0.5 / base_quant.LEVELS, "nf4": max(np.diff(base_quant.NF4)) / 2}


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_codes_and_scales_round_within_half_a_level(kind):
    """A stacked (layers, in, heads, out) weight: every element within
    BOUND x its block's amax of the weight; a weight made of levels times
    its scales comes back exactly; scales run over the first dimension
    after the layers, in blocks of the configured size."""
    w = jax.random.normal(jax.random.key(0), (2, 128, 3, 5), jnp.float32)
    fmt = base_quant.format_of(kind, w.shape, ("layers", "embed", "heads", "kv"), 64)
    assert fmt.block == (128 if kind == "int8" else 64) and fmt.dim == -3
    q = base_quant.quantize(w, fmt)
    assert q.codes.shape == w.shape and q.codes.dtype == fmt.code_dtype
    assert q.scale.shape == (2, 128 // fmt.block, 3, 5)
    back = base_quant.dequantize(q.codes, q.scale, fmt, jnp.float32)
    blocks = np.abs(np.asarray(w)).reshape(2, 128 // fmt.block, fmt.block, 3, 5).max(2)
    bound = np.repeat(blocks, fmt.block, axis=1) * BOUND[kind] * (1 + 1e-6)
    assert np.all(np.abs(np.asarray(back) - np.asarray(w)) <= bound)
    again = base_quant.quantize(back, fmt)  # levels x scales: a fixed point
    np.testing.assert_array_equal(np.asarray(again.codes, np.int32), np.asarray(q.codes, np.int32))
    np.testing.assert_allclose(base_quant.dequantize(again.codes, again.scale, fmt, jnp.float32),
                               back, rtol=1e-6)


def _quantized_bytes(frozen) -> int:
    """The frozen base's bytes from its shapes: codes at 1 byte (int8) or
    half a byte (nf4) an element, float32 scales, the rest float32."""
    total = 0
    for x in jax.tree.leaves(frozen, is_leaf=lambda x: isinstance(x, base_quant.Quantized)):
        if isinstance(x, base_quant.Quantized):
            n = int(np.prod(x.codes.shape))
            total += (n if x.fmt.kind == "int8" else n // 2) + 4 * int(np.prod(x.scale.shape))
        else:
            total += 4 * int(np.prod(x.shape))
    return total


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_base_trains_like_one_device_and_is_gathered_as_stored(corpus, kind):
    """Rank-8 q,v adapters on a base whose block projections are `kind`:
    ten steps on fsdp=8 at ZeRO-3 give one device's losses and adapters
    to 1e-5, the codes and scales stay bitwise as stored, the base is
    within its rounding bound of the unquantized one and starts within 1%
    of its loss; the compiled step gathers the projections' codes in 8
    bits and never a projection's weight in float32; the memory report
    counts the codes at their bits."""
    extra = dict(lora_quantize_base=kind)
    losses, adapters, frozen, base = _train(corpus, "fsdp=8", 3, **extra)
    ref_losses, ref_adapters, _, _ = _train(corpus, "fsdp=1", 3, devices=jax.devices()[:1],
                                            **extra)
    plain_losses, _, plain, _ = _train(corpus, "fsdp=1", 3, devices=jax.devices()[:1])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 adapters, ref_adapters)
    jax.tree.map(np.testing.assert_array_equal, frozen, base)
    assert abs(losses[0] - plain_losses[0]) < 0.01 * plain_losses[0]
    w_q = frozen["blocks"]["w_q"]
    assert isinstance(w_q, base_quant.Quantized) and w_q.codes.dtype == w_q.fmt.code_dtype
    assert frozen["wte"].dtype == np.float32  # embeddings and norms are kept as they were
    back = base_quant.dequantize(jnp.asarray(w_q.codes), jnp.asarray(w_q.scale), w_q.fmt,
                                 jnp.float32)
    err = np.abs(np.asarray(back) - plain["blocks"]["w_q"])
    assert err.max() <= BOUND[kind] * np.abs(plain["blocks"]["w_q"]).max() * (1 + 1e-6)

    job = make_job(corpus, model="llama-tiny", precision="fp32", mesh="fsdp=8", zero_stage=3,
                   lora_rank=8, lora_targets="q,v", **extra)
    compiled, partitioned = job.compile_with_text()
    text = compiled.as_text()
    job.collectives(partitioned)  # what the printed plan reads: 4-bit arrays among them
    gathers = [line.split("=")[1].split("all-gather")[0].strip() for line in text.splitlines()
               if "all-gather(" in line or "all-gather-start(" in line]
    layer = ",".join(map(str, w_q.codes.shape[1:]))
    assert any(g.startswith((f"s8[{layer}]", f"u8[{layer}]")) for g in gathers), gathers
    assert not any(g.startswith(f"f32[{layer}]") for g in gathers), gathers
    plan = job.state_plan
    assert memory._frozen_bytes(plan) == _quantized_bytes(host(frozen))
    unquantized = make_job(corpus, model="llama-tiny", precision="fp32", mesh="fsdp=8",
                           zero_stage=3, lora_rank=8, lora_targets="q,v").state_plan
    assert memory.sharded(plan)["params"] < memory.sharded(unquantized)["params"]
    assert memory.param_count(plan) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
        (plain, adapters)))


def test_a_base_read_from_hugging_face_is_stored_quantized(corpus, tmp_path):
    """--init-from a Hugging Face directory with --lora-quantize-base nf4 on
    fsdp=4,tensor=2: the frozen base is the file's weights, the block
    projections quantized from them in the base's layout, the rest in the
    compute dtype. Its digest is the weights' before quantization (an
    unquantized run's): what --merge-lora checks on the host passes."""
    _, params = _hf_base(corpus, tmp_path / "hf", scale=0.05)
    hf = dict(model=f"hf:{tmp_path / 'hf'}", init_from=str(tmp_path / "hf"),
              mesh="fsdp=4,tensor=2", precision="fp32", lora_rank=8, lora_targets="q,v")
    job = make_job(corpus, lora_quantize_base="nf4", **hf)
    loaded, _, base_digest = run.initial_state(job, None, [models.hf_loader], print)
    frozen = host(loaded.frozen)
    w_q = frozen["blocks"]["w_q"]
    expected = base_quant.quantize(jnp.asarray(params["blocks"]["w_q"]), w_q.fmt)
    np.testing.assert_array_equal(np.asarray(w_q.codes, np.int32),
                                  np.asarray(expected.codes, np.int32))
    np.testing.assert_allclose(w_q.scale, expected.scale, rtol=1e-6)
    np.testing.assert_array_equal(frozen["wte"], params["wte"])
    assert [x.sharding for x in jax.tree.leaves(loaded.frozen)] == jax.tree.leaves(
        job.state_plan.shardings.frozen)
    assert base_digest == weights.base(make_job(corpus, **hf), [models.hf_loader])[1]
    meta = {**weights.base_meta(job, base_digest), "precision": {"compute": "float32"}}
    read, paths = lora_merge.base_reader(meta, job.model.config)
    lora_merge.check_digest(meta, job.model.config, read, paths)  # raises if it differs


def test_a_quantized_run_resumes_only_quantized_alike(corpus):
    """A checkpoint of adapters trained on an nf4 base names it: resuming
    without --lora-quantize-base nf4 is refused before compiling, saying so."""
    extra = dict(model="llama-tiny", precision="fp32", mesh="fsdp=8", lora_rank=8,
                 lora_targets="q,v", steps=2)
    job = make_job(corpus, lora_quantize_base="nf4", **extra)
    meta = weights.base_meta(job, weights.base(job)[1])
    assert meta["lora_base"]["quantize_base"] == "nf4"
    with pytest.raises(weights.WrongBase, match="stored nf4.*with --lora-quantize-base nf4"):
        weights._same_source(meta, make_job(corpus, **extra), "ckpt/2")
