"""The Llama family (models/llama/model.py): attention against its formula,
the published parameter counts, every layout against one device, key/value
heads the tensor axis does not divide, and Hugging Face weights in and out
(models/common/hf_files.py, models/llama/hf.py) without transformers
(tests/interop has the checks that need it).

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
from models import llama
from models.common import hf_files, layers
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
    assert_close(job.state_plan.saved_form(state).params, ref_params, RTOL)


def test_kv_heads_the_tensor_axis_does_not_divide_are_replicated(corpus, reference):
    """llama-tiny's 4 key/value heads on tensor=8: replicated within the
    tensor group, said in the plan, and the step computes what one device
    does."""
    job = _job(corpus, 3, "tensor=8")
    assert job.notes == ("kv_heads: 4 not divisible by tensor=8, so replicated within each "
                         "tensor group",)
    assert job.state_plan.rules.mesh_axes("kv_heads") == () and job.state_plan.rules.mesh_axes("heads")
    losses, _ = train(job, corpus, steps=2)
    np.testing.assert_allclose(losses, reference[0][:2], rtol=RTOL)


def _save_hf(tmp, cfg, params, max_shard_bytes=hf_files.MAX_SHARD_BYTES, dtype="float32"):
    """Our parameters (layer order) written as a Hugging Face directory."""
    def read(path, layer):
        x = params
        for key in path.split("."):
            x = x[key]
        return np.asarray(x if layer is None else x[layer])
    return models.save_hf(tmp, cfg, read, max_shard_bytes, dtype)


@pytest.mark.parametrize("name,mesh", [("llama-tiny", "fsdp=4,tensor=2")]
                         + [("gpt-tiny", "fsdp=8")] * FULL)
def test_hugging_face_weights_round_trip_exactly(corpus, tmp_path, name, mesh):
    """Export in Hugging Face's layout, whole and in 64 KB files with an
    index, then import into a ZeRO-3 layout, one tensor at a time: bit for
    bit, in the layout's shardings. The shape comes from config.json."""
    job = make_job(corpus, model=name, mesh=mesh, zero_stage=3)
    params = host(job.state_plan.saved_form(initial_state(job)).params)
    for out, shard in ((tmp_path / "whole", hf_files.MAX_SHARD_BYTES), (tmp_path / "sharded", 65536)):
        files = _save_hf(out, job.model.config, params, shard)
        assert (len(files) > 1) == (out.name == "sharded") == (out / hf_files.INDEX).exists()
        imported_job = make_job(corpus, model=f"hf:{out}", mesh=mesh, zero_stage=3)
        assert imported_job.model.config == job.model.config
        imported = run.load_params(str(out), imported_job, loaders=[models.hf_loader])
        jax.tree.map(np.testing.assert_array_equal, host(imported), params)
        targets = imported_job.state_plan.targets.params
        assert jax.tree.map(lambda x, t: x.sharding == t.sharding, imported, targets) == \
            jax.tree.map(lambda _: True, targets)


def test_a_bf16_directory_is_placed_as_its_values_cast_per_policy(corpus, tmp_path):
    """A bf16 Hugging Face directory stays bf16 on the host (what the
    sources hand to placing) and is placed as the file's values, cast per
    the policy: bit for bit into bfloat16 parameters, exactly widened into
    float32 ones, in the layout's shardings."""
    job = make_job(corpus, model="llama-tiny", mesh="fsdp=4,tensor=2", zero_stage=3)
    params = host(job.state_plan.saved_form(initial_state(job)).params)
    _save_hf(tmp_path, job.model.config, params, dtype="bfloat16")
    sources = llama.hf.sources(job.model.config)
    tensors = hf_files.Tensors(tmp_path)
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
        targets = imported_job.state_plan.targets.params
        assert jax.tree.map(lambda x, t: x.sharding == t.sharding, imported, targets) == \
            jax.tree.map(lambda _: True, targets)


def test_a_config_that_does_not_match_the_model_names_both(corpus, tmp_path):
    job = make_job(corpus, model="llama-tiny", mesh="fsdp=8")
    _save_hf(tmp_path, job.model.config, host(job.state_plan.saved_form(initial_state(job)).params))
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
    cfg = llama.model.LlamaConfig(vocab_size=16384, n_layer=2, n_head=8, n_kv_head=4, d_model=1024,
                                  d_mlp=1024, max_seq_len=256, tie_embeddings=True)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(models.model_fns(cfg).init, jax.random.key(0))
    models.save_hf(tmp_path, cfg, lambda path, layer: rng.standard_normal(
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


# config.json keys that shape attention, read as transformers 5's class for
# each model_type reads them (tests/interop/test_attention_keys.py checks the
# logits against transformers itself).
BASE = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
            intermediate_size=128, vocab_size=256, max_position_embeddings=64)
FAMILY = {"llama": {}, "mistral": {}, "qwen2": {},
          "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
          "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48),
          "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}


def _config(kind, **keys):
    return {"model_type": kind, **BASE, **FAMILY[kind], **keys}


SLIDING = ["sliding_attention"] * 2
WINDOWS = [  # (model_type, keys, the window every layer gets)
    ("mixtral", dict(sliding_window=16), 16),  # whenever set
    ("mixtral", {}, 0),
    ("mistral", dict(sliding_window=16), 16),
    ("mistral", dict(sliding_window=None), 0),
    ("mistral", {}, 4096),  # MistralConfig's default
    ("llama", dict(sliding_window=16, use_sliding_window=True), 0),  # LlamaForCausalLM has none
    ("qwen2", dict(sliding_window=16), 0),  # only with use_sliding_window
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=0), 16),
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=2), 0),
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=2,
                   layer_types=SLIDING), 16),  # the list wins over max_window_layers
    ("qwen2_moe", dict(sliding_window=16, use_sliding_window=True, layer_types=SLIDING), 16),
    ("qwen2_moe", dict(sliding_window=16, use_sliding_window=True, max_window_layers=0), 0),
    ("qwen2_moe", dict(sliding_window=0, use_sliding_window=False), 0),  # as Qwen2MoeConfig saves
    ("qwen3_moe", dict(sliding_window=16, use_sliding_window=True), 16),
    ("qwen3_moe", dict(sliding_window=16, use_sliding_window=False), 0),
]


@pytest.mark.parametrize("kind,keys,window", WINDOWS)
def test_each_family_reads_the_window_its_transformers_class_applies(kind, keys, window):
    fields = llama.hf.shape_from(_config(kind, **keys))
    assert fields.get("sliding_window", 0) == window
    if window:  # and writes it back so that the class applies it again
        cfg = llama.model.LlamaConfig(**fields)
        written = llama.hf.config_json(cfg)
        assert llama.hf.layer_windows(written, kind) == [window] * cfg.n_layer
        assert llama.model.LlamaConfig(**llama.hf.shape_from(written)) == cfg


REFUSED = [  # (model_type, keys, what the one-line error says)
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1),
     r"sliding_attention on layers \[1\] of 2 only .*max_window_layers = 1"),
    ("qwen2_moe", dict(sliding_window=16, use_sliding_window=True),  # every other layer
     r"sliding_attention on layers \[0\] of 2 only \(use_sliding_window = True"),
    ("qwen2", dict(sliding_window=16, layer_types=SLIDING),
     "layer_types names sliding_attention layers but use_sliding_window = False"),
    ("mistral", dict(sliding_window=0), "sliding_window = 0 is not supported"),
    ("llama", dict(attention_bias=True), "attention_bias = True .*o_proj bias"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias = True .*o_proj bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias = True"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "rope_type = 'yarn' is not supported"),
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0}, partial_rotary_factor=0.5),
     "partial_rotary_factor = 0.5"),
]


@pytest.mark.parametrize("kind,keys,message", REFUSED)
def test_a_key_the_model_cannot_compute_is_refused_in_one_line(kind, keys, message):
    with pytest.raises(ValueError, match=message) as e:
        llama.hf.shape_from(_config(kind, **keys), where="dir/config.json")
    assert str(e.value).startswith("dir/config.json: ") and "\n" not in str(e.value)


def test_keys_a_class_ignores_are_ignored_and_defaults_are_its_own():
    """Mistral's and Mixtral's attention has no biases whatever
    attention_bias says, Qwen2's always has q/k/v biases, Qwen2-MoE's unless
    qkv_bias is false; a Mixtral without rope_theta rotates at 1e6, as
    MixtralConfig does; rope_scaling wins over rope_parameters, as in
    transformers, and partial_rotary_factor acts only with scaling."""
    shape = llama.hf.shape_from
    assert not shape(_config("mistral", attention_bias=True))["qkv_bias"]
    assert shape(_config("qwen2", attention_bias=False))["qkv_bias"]
    assert shape(_config("qwen2_moe"))["qkv_bias"]
    assert not shape(_config("qwen2_moe", qkv_bias=False))["qkv_bias"]
    assert shape(_config("mixtral"))["rope_theta"] == 1e6
    assert shape(_config("mistral"))["rope_theta"] == 1e4
    assert shape(_config("mistral", rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                         partial_rotary_factor=0.5))["rope_theta"] == 5e5
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0}
    fields = shape(_config("llama", rope_scaling=llama3,
                           rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert fields["rope_scaling"] == (8.0, 1.0, 4.0, 64)  # original length: the config's
    assert fields["rope_theta"] == 1e4  # rope_scaling is the table read; its base is the file's


@pytest.mark.parametrize("fields,message", [
    (dict(family="llama", sliding_window=16), "sliding_window = 16 cannot be exported: "
                                              "LlamaForCausalLM has no sliding window"),
    (dict(family="mistral", qkv_bias=True), "qkv_bias = True cannot be exported as "
                                            "MistralForCausalLM, whose q/k/v projections never"),
    (dict(family="qwen2"), "qkv_bias = False cannot be exported as Qwen2ForCausalLM"),
])
def test_an_export_its_architecture_cannot_compute_is_refused_before_writing(tmp_path, fields,
                                                                             message):
    cfg = llama.model.LlamaConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                                  d_mlp=128, max_seq_len=64, **fields)
    read = _random_reader(cfg)
    with pytest.raises(ValueError, match=message):
        models.save_hf(tmp_path / "hf", cfg, read)
    assert not list((tmp_path / "hf").iterdir())


def _random_reader(cfg, seed=0):
    """`read(path, layer)` giving random parameters of `cfg`'s shapes."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(models.model_fns(cfg).init, jax.random.key(0))
    return lambda path, layer: rng.standard_normal(
        _leaf_shape(shapes, path)[0 if layer is None else 1:]).astype(np.float32)


def test_a_missing_shard_is_named_before_any_shard_is_read(corpus, tmp_path):
    """A directory whose index names files that are not there: the import
    says which, in one line, before opening any shard (the first one here
    is not even a safetensors file, and is not what the error is about)."""
    cfg = llama.model.LlamaConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                                  d_mlp=128, max_seq_len=64)
    files = models.save_hf(tmp_path, cfg, _random_reader(cfg), max_shard_bytes=40_000)
    assert len(files) >= 4 and (tmp_path / hf_files.INDEX).exists()
    files[0].write_bytes(b"not a safetensors file")
    files[2].unlink()
    job = make_job(corpus, model=f"hf:{tmp_path}", mesh="fsdp=8")
    with pytest.raises(FileNotFoundError) as e:
        models.hf_loader(str(tmp_path), job)
    assert str(e.value) == (f"{tmp_path / hf_files.INDEX} names {files[2].name}, which is missing "
                            f"from {tmp_path}: copy or download every file the index names")
    files[3].unlink()
    with pytest.raises(FileNotFoundError, match=rf"names {files[2].name}, {files[3].name} "
                                                rf"\(2 of its {len(files)} files\), which are "
                                                rf"missing from {tmp_path}: "):
        hf_files.Tensors(tmp_path)
