"""Every config.json key that shapes attention, per family, imports and
exports as transformers reads it (models/llama/hf.py, models/gpt/hf.py).

Each case is a transformers model built from a small config that sets the
keys (a sliding window and the flags and layer lists that switch it on,
Llama 3 rope scaling, head sizes other than d_model / heads, q/k/v biases
switched off, GPT-2's LayerNorm epsilon and MLP width), with random weights,
saved with `save_pretrained`, over T = 64 tokens, four times the window:
  - the import computes transformers' logits (float32) within the case's
    tolerance, and the window it read is the one that acts: without it our
    logits move by more than 1e-2;
  - export -> `from_pretrained` has the keys back, computes what the
    original computed (the same weights), and so our logits within the
    case's tolerance.
The tolerance is float32's at the case's scale: 1e-5 for the Mixtral, drawn
as transformers draws it (logits up to about 1); 1e-4 for the others, drawn
10x wider so that attention is peaked enough for rope scaling to move the
logits by units (logits up to about 8, where the two float32 programs differ
by up to 4.5e-5; the Mixtral drawn that wide differs by 1.9e-4, and each
program is then 2.6e-4 from transformers' float64 evaluation).
The Mixtral with a window is also imported onto `expert=2,fsdp=4` (8
devices, ZeRO-3). Configs whose attention this model cannot compute (a
window on some layers only, an o_proj bias, ...) are refused on import, in
one line naming the key.

Run by `make test-interop`.
"""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="make test-interop installs torch")
transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")

import models  # noqa: E402
from tests.interop.roundtrip import exported, imported, logits  # noqa: E402

T, WINDOW = 64, 16
DENSE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
             initializer_range=0.2)
MOE = dict(DENSE, num_experts_per_tok=2)
# 6 query heads over 2 kv heads of 32, 6 experts, top-2, transformers' own
# initialisation (its router still sends tokens to varied experts).
MIXTRAL = dict(vocab_size=384, hidden_size=192, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, head_dim=32, intermediate_size=128, num_local_experts=6,
               num_experts_per_tok=2, max_position_embeddings=T, sliding_window=WINDOW)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
t = transformers
CASES = {  # name: (config class, model class, config, the window it sets, tolerance)
    "mixtral_window": (t.MixtralConfig, t.MixtralForCausalLM, MIXTRAL, WINDOW, 1e-5),
    "mistral_window_head_dim": (t.MistralConfig, t.MistralForCausalLM,
                                dict(DENSE, sliding_window=WINDOW, head_dim=24), WINDOW, 1e-4),
    "qwen2_window_head_dim": (t.Qwen2Config, t.Qwen2ForCausalLM,
                              dict(DENSE, use_sliding_window=True, sliding_window=WINDOW,
                                   max_window_layers=0, head_dim=24), WINDOW, 1e-4),
    "qwen2_moe_window_no_bias": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM,
                                 dict(MOE, moe_intermediate_size=48, num_experts=4,
                                      shared_expert_intermediate_size=80, use_sliding_window=True,
                                      sliding_window=WINDOW, qkv_bias=False,
                                      layer_types=["sliding_attention"] * 2), WINDOW, 1e-4),
    "qwen3_moe_window_head_dim": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM,
                                  dict(MOE, moe_intermediate_size=48, num_experts=4, head_dim=24,
                                       use_sliding_window=True, sliding_window=WINDOW), WINDOW,
                                  1e-4),
    "llama_rope_scaling_head_dim": (t.LlamaConfig, t.LlamaForCausalLM,
                                    dict(DENSE, rope_theta=5e5, rope_scaling=LLAMA3, head_dim=24),
                                    0, 1e-4),
    "gpt2_eps": (t.GPT2Config, t.GPT2LMHeadModel,
                 dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=96,
                      n_positions=T, layer_norm_epsilon=1e-2, initializer_range=0.2), 0, 1e-4),
}
TOKENS = np.random.default_rng(0).integers(0, 256, size=(8, T))  # 8 rows: expert=2,fsdp=4 splits them


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    config_cls, model_cls, fields, window, atol = CASES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**fields, torch_dtype=torch.float32)).eval()
    with torch.no_grad():  # non-zero biases, so that a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(directory)
    with torch.no_grad():
        theirs = model(torch.tensor(TOKENS)).logits.numpy()
    return request.param, model_cls, window, atol, theirs, directory


def test_imported_keys_compute_transformers_logits(corpus, saved):
    name, _, window, atol, theirs, directory = saved
    job, params = imported(corpus, directory, "data=1", 1)
    cfg = job.model.config
    ours = logits(job, params, TOKENS)
    print(f"{name}: max |logits difference| {np.abs(ours - theirs).max():.2e} "
          f"(logits up to {np.abs(theirs).max():.2f})")
    np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)
    if window:
        assert cfg.sliding_window == window
        whole = models.model_fns(dataclasses.replace(cfg, sliding_window=0))
        moved = np.abs(np.asarray(whole.logits(params, TOKENS, job.hooks)) - ours).max()
        print(f"{name}: without the window our logits move by up to {moved:.2f}")
        assert moved > 1e-2, "the window changes nothing here"


@pytest.mark.parametrize("saved", ["mixtral_window"], indirect=True)
def test_the_mixtral_window_holds_on_expert_and_fsdp_axes(corpus, saved):
    name, _, _, atol, theirs, directory = saved
    job, params = imported(corpus, directory, "expert=2,fsdp=4", 8)
    assert job.model.config.sliding_window == WINDOW
    ours = logits(job, params, TOKENS)
    print(f"{name} on expert=2,fsdp=4: max |logits difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)


def test_export_has_the_keys_and_transformers_computes_our_logits(corpus, saved, tmp_path):
    name, model_cls, _, atol, theirs, directory = saved
    job, params = imported(corpus, directory, "data=1", 1)
    ours = logits(job, params, TOKENS)
    back = model_cls.from_pretrained(exported(job, params, tmp_path), torch_dtype=torch.float32)
    source = transformers.AutoConfig.from_pretrained(directory)
    for key in ("sliding_window", "use_sliding_window", "layer_types", "head_dim", "qkv_bias",
                "rope_parameters", "layer_norm_epsilon", "n_inner"):
        if hasattr(source, key):
            assert getattr(back.config, key) == getattr(source, key), key
    with torch.no_grad():
        again = back.eval()(torch.tensor(TOKENS)).logits.numpy()
    print(f"{name}: export reloaded, max |logits difference| {np.abs(again - ours).max():.2e} "
          f"from ours, {np.abs(again - theirs).max():.2e} from the original's")
    # The same weights, so the same logits; but for GPT-2's key bias, which
    # the softmax cancels and the export writes as zeros (models/gpt/hf.py).
    np.testing.assert_allclose(again, theirs, atol=1e-5 if name == "gpt2_eps" else 0, rtol=0)
    np.testing.assert_allclose(again, ours, atol=atol, rtol=0)


REFUSED = {  # config the model cannot compute -> what the one-line error names
    "qwen2_window_on_some_layers": (
        t.Qwen2Config(**DENSE, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1), r"sliding_attention.*layers \[1\] of 2.*max_window_layers"),
    "qwen2_moe_window_on_alternate_layers": (
        t.Qwen2MoeConfig(**dict(DENSE, num_hidden_layers=3), use_sliding_window=True,
                         sliding_window=WINDOW),
        r"sliding_attention.*layers \[0, 2\] of 3.*layer_types"),
    "llama_o_proj_bias": (t.LlamaConfig(**DENSE, attention_bias=True),
                          "attention_bias = True.*o_proj"),
    "qwen3_moe_o_proj_bias": (t.Qwen3MoeConfig(**MOE, attention_bias=True),
                              "attention_bias = True.*o_proj"),
    "linear_rope": (t.LlamaConfig(**DENSE, rope_scaling={"rope_type": "linear", "factor": 2.0}),
                    "rope_type = 'linear'"),
    "partial_rotary_llama3": (t.LlamaConfig(**DENSE, rope_scaling=dict(LLAMA3),
                                            partial_rotary_factor=0.5),
                              "partial_rotary_factor = 0.5"),
    "gpt2_layer_scaled_attention": (t.GPT2Config(scale_attn_by_inverse_layer_idx=True),
                                    "scale_attn_by_inverse_layer_idx = True"),
    "gpt2_unscaled_attention": (t.GPT2Config(scale_attn_weights=False),
                                "scale_attn_weights = False"),
    "gpt2_relu": (t.GPT2Config(activation_function="relu"), "activation_function = 'relu'"),
    "gpt2_untied_head": (t.GPT2Config(tie_word_embeddings=False), "tie_word_embeddings = False"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_config_this_model_cannot_compute_is_refused_naming_the_key(name, tmp_path):
    config, message = REFUSED[name]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message) as e:
        models.hf_shape(tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path / "config.json") in str(e.value)
