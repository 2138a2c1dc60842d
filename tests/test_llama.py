"""The Llama family (models/llama.py): attention against its formula, the
published parameter counts, every layout against one device, key/value heads
the tensor axis does not divide, and Hugging Face weights in and out
(models/hf.py) without transformers (tests/interop has the checks that
need it).

CI runs one layout of the numerics grid (ZeRO-3 with tensor and sequence
parallelism) and the Llama round trip; ZERO_JAX_FULL_GRID=1 runs every stage
on every mesh, and the GPT round trip too.
"""

import itertools
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
from models import hf, layers, llama, llama_hf
from tests.helpers import assert_close, host, initial_state, make_job, train
from zero_jax import run

ROOT = Path(__file__).resolve().parent.parent
MESHES = {
    "fsdp=8": {},
    "data=2,fsdp=4": {},
    "fsdp=4,tensor=2": dict(layout="fsdp_tp_sp"),
    "pipe=2,fsdp=4": dict(microbatches=2),
}
GRID = list(itertools.product(range(4), MESHES))
FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
CASES = GRID if FULL else [(3, "fsdp=4,tensor=2")]
RTOL = 1e-5


def _job(corpus, stage, mesh, **extra):
    return make_job(corpus, model="llama-tiny", mesh=mesh, zero_stage=stage, precision="fp32",
                    batch_size=32, **{**MESHES.get(mesh, {}), **extra})


@pytest.mark.parametrize("window", [0, 5])
def test_attention_matches_jax_dot_product_attention(window):
    """The written-out attention against `jax.nn.dot_product_attention`'s
    XLA implementation: grouped-query (4 query heads over 2 key/value
    heads), causal, float32, with and without a sliding window; and their
    gradients."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, 8)), jnp.float32) for _ in range(2))
    jaxs = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla",
        local_window_size=(window - 1, 0) if window else None)
    ours = lambda q, k, v: layers.attention(q, k, v, "xla", window)
    np.testing.assert_allclose(ours(q, k, v), jaxs(q, k, v), atol=1e-5, rtol=1e-5)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for g_ours, g_jax in zip(jax.grad(loss(ours), (0, 1, 2))(q, k, v),
                             jax.grad(loss(jaxs), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g_ours, g_jax, atol=1e-5, rtol=1e-5)


def test_presets_have_the_published_parameter_counts(corpus):
    """Counted from the arrays' abstract shapes, as memory_report.py does."""
    published = {"llama-2-70b": 68_976_648_192, "llama-3-8b": 8_030_261_248,
                 "llama-3.1-8b": 8_030_261_248}
    for name, count in published.items():
        cfg = models.config(name, 256)
        assert cfg.param_count == count
        shapes = jax.eval_shape(models.model_fns(cfg).init, jax.random.key(0))
        assert sum(int(np.prod(x.value.shape)) for x in jax.tree.leaves(
            shapes, is_leaf=lambda x: hasattr(x, "value"))) == count


@pytest.fixture(scope="module")
def reference(corpus):
    job = _job(corpus, 0, "fsdp=1", devices=jax.devices()[:1])
    losses, state = train(job, corpus)
    return losses, host(state.params)


@pytest.mark.parametrize("stage,mesh", CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_ten_steps_match_one_device(corpus, reference, stage, mesh):
    ref_losses, ref_params = reference
    job = _job(corpus, stage, mesh)
    losses, state = train(job, corpus)
    assert losses[-1] < losses[0] - 0.5, "the loss should fall over ten steps"
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_close(job.layout.saved_form(state).params, ref_params, RTOL)


def test_kv_heads_the_tensor_axis_does_not_divide_are_replicated(corpus, reference):
    """llama-tiny's 4 key/value heads on tensor=8: replicated within the
    tensor group, said in the plan, and the step computes what one device
    does."""
    job = _job(corpus, 3, "tensor=8")
    assert job.notes == ("kv_heads: 4 not divisible by tensor=8, so replicated within each "
                         "tensor group",)
    assert job.layout.rules.mesh_axes("kv_heads") == () and job.layout.rules.mesh_axes("heads")
    losses, _ = train(job, corpus, steps=2)
    np.testing.assert_allclose(losses, reference[0][:2], rtol=RTOL)


def _save_hf(tmp, cfg, params, max_shard_bytes=hf.MAX_SHARD_BYTES, dtype="float32"):
    """Our parameters (layer order) written as a Hugging Face directory."""
    def read(path, layer):
        x = params
        for key in path.split("."):
            x = x[key]
        return np.asarray(x if layer is None else x[layer])
    return hf.save(tmp, cfg, read, max_shard_bytes, dtype)


@pytest.mark.parametrize("name,mesh", [("llama-tiny", "fsdp=4,tensor=2")]
                         + [("gpt-tiny", "fsdp=8")] * FULL)
def test_hugging_face_weights_round_trip_exactly(corpus, tmp_path, name, mesh):
    """Export in Hugging Face's layout, whole and in 64 KB files with an
    index, then import into a ZeRO-3 layout, one tensor at a time: bit for
    bit, in the layout's shardings. The shape comes from config.json."""
    job = make_job(corpus, model=name, mesh=mesh, zero_stage=3)
    params = host(job.layout.saved_form(initial_state(job)).params)
    for out, shard in ((tmp_path / "whole", hf.MAX_SHARD_BYTES), (tmp_path / "sharded", 65536)):
        files = _save_hf(out, job.model.config, params, shard)
        assert (len(files) > 1) == (out.name == "sharded") == (out / hf.INDEX).exists()
        imported_job = make_job(corpus, model=f"hf:{out}", mesh=mesh, zero_stage=3)
        assert imported_job.model.config == job.model.config
        imported = run.load_params(str(out), imported_job, loaders=[models.hf_loader])
        jax.tree.map(np.testing.assert_array_equal, host(imported), params)
        targets = imported_job.layout.targets.params
        assert jax.tree.map(lambda x, t: x.sharding == t.sharding, imported, targets) == \
            jax.tree.map(lambda _: True, targets)


def test_a_bf16_directory_is_placed_as_its_values_cast_per_policy(corpus, tmp_path):
    """A bf16 Hugging Face directory stays bf16 on the host (what the
    sources hand to placing) and is placed as the file's values, cast per
    the policy: bit for bit into bfloat16 parameters, exactly widened into
    float32 ones, in the layout's shardings."""
    job = make_job(corpus, model="llama-tiny", mesh="fsdp=4,tensor=2", zero_stage=3)
    params = host(job.layout.saved_form(initial_state(job)).params)
    _save_hf(tmp_path, job.model.config, params, dtype="bfloat16")
    sources = llama_hf.sources(job.model.config)
    tensors = hf.Tensors(tmp_path)
    assert sources["wte"](tensors.get, None).dtype == jnp.bfloat16
    assert sources["blocks.w_q"](tensors.get, 1).dtype == jnp.bfloat16
    in_file = jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16)), params)
    for dtype in ("bfloat16", "float32"):
        imported_job = make_job(corpus, model=f"hf:{tmp_path}", mesh="fsdp=4,tensor=2",
                                zero_stage=3, param_dtype=dtype)
        imported = run.load_params(str(tmp_path), imported_job, loaders=[models.hf_loader])
        assert {x.dtype for x in jax.tree.leaves(imported)} == {jnp.dtype(dtype)}
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b, dtype)),
                     host(imported), in_file)
        targets = imported_job.layout.targets.params
        assert jax.tree.map(lambda x, t: x.sharding == t.sharding, imported, targets) == \
            jax.tree.map(lambda _: True, targets)


def test_a_config_that_does_not_match_the_model_names_both(corpus, tmp_path):
    job = make_job(corpus, model="llama-tiny", mesh="fsdp=8")
    _save_hf(tmp_path, job.model.config, host(job.layout.saved_form(initial_state(job)).params))
    other = make_job(corpus, model="llama-tiny", mesh="fsdp=8", n_kv_head=2)
    with pytest.raises(ValueError, match="n_kv_head 4 there, 2 in the model"):
        models.hf_loader(str(tmp_path), other)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_holds_about_one_tensor_in_host_memory(tmp_path, dtype):
    """A model whose largest tensor (the tied embedding) is 64 MiB placed
    (float32): the import's peak resident memory beyond the parameters it
    placed (on CPU the devices' memory is the host's) stays within 3 x 64
    MiB, and the numpy arrays it holds at once within 1.5 x that tensor in
    the file's dtype: a bf16 file is not widened on the host."""
    cfg = llama.LlamaConfig(vocab_size=16384, n_layer=2, n_head=8, n_kv_head=4, d_model=1024,
                            d_mlp=1024, max_seq_len=256, tie_embeddings=True)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(models.model_fns(cfg).init, jax.random.key(0))
    hf.save(tmp_path, cfg, lambda path, layer: rng.standard_normal(
        _leaf_shape(shapes, path)[0 if layer is None else 1:], np.float32), dtype=dtype)
    out = subprocess.run([sys.executable, "scripts/import_memory.py", str(tmp_path), "--json"],
                         cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    largest = 16384 * 1024 * 4
    assert report["largest_tensor_bytes"] == largest
    print(report)
    assert report["peak_beyond_params_bytes"] <= 3 * largest
    in_file = largest * np.dtype(dtype).itemsize // 4
    assert report["host_arrays_peak_bytes"] <= 1.5 * in_file


def _leaf_shape(tree, path):
    x = tree
    for key in path.split("."):
        x = x[key]
    return tuple(x.value.shape)


def test_llama_fields_on_a_gpt_are_refused(corpus):
    with pytest.raises(ValueError, match="n_kv_head: Llama-family fields"):
        make_job(corpus, model="gpt-tiny", n_kv_head=2)
