"""Mixture-of-experts checkpoints written by transformers import into
zero_jax and export back (models/llama/hf.py, scripts/export.py).

For MixtralForCausalLM (8 experts, top-2), Qwen2MoeForCausalLM (q/k/v
biases, a sigmoid-gated shared expert of its own width, top-2 not
renormalised) and Qwen3MoeForCausalLM (q/k norms, 8 experts of their own
width, top-2 renormalised), built by
transformers from a small config with random weights and saved with
`save_pretrained`:
  - the import computes transformers' logits, float32, within 1e-4, on one
    device and on expert=2,fsdp=2 with ZeRO-3 (dropless);
  - export -> `from_pretrained` gives the same logits, and `generate`'s 20
    greedy tokens equal zero_jax's greedy decode.

Run by `make test-interop`.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="make test-interop installs torch")
transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")

from tests.interop.roundtrip import (  # noqa: E402
    assert_same_greedy_text, exported, imported, logits)
SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
             initializer_range=0.2)  # wide enough that greedy text and routing vary
ARCHITECTURES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=96, num_local_experts=8, rope_theta=1e6,
                     sliding_window=None)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                       shared_expert_intermediate_size=80, norm_topk_prob=False,
                       rope_theta=1e6, use_sliding_window=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                       head_dim=16, norm_topk_prob=True, rope_theta=1e6,
                       use_sliding_window=False)),
}
TOKENS = np.random.default_rng(0).integers(0, 256, size=(4, 24))  # 4 rows: expert=2,fsdp=2 splits them


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def saved(request, tmp_path_factory):
    """A randomly initialised transformers model, saved."""
    config_cls, model_cls, extra = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **extra, torch_dtype=torch.float32)).eval()
    tmp = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(tmp / "whole")
    with torch.no_grad():
        expected = model(torch.tensor(TOKENS)).logits.numpy()
    return request.param, model_cls, model, expected, tmp


@pytest.mark.parametrize("mesh,n", [("data=1", 1), ("expert=2,fsdp=2", 4)])
def test_imported_weights_compute_transformers_logits(corpus, saved, mesh, n):
    name, _, _, theirs, tmp = saved
    job, params = imported(corpus, tmp / "whole", mesh, n)
    ours = logits(job, params, TOKENS)
    print(f"{name} on {mesh}: max |logits difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_export_loads_in_transformers_and_generates_the_same_text(corpus, saved, tmp_path):
    name, model_cls, model, theirs, tmp = saved
    job, params = imported(corpus, tmp / "whole", "data=1", 1)
    back = model_cls.from_pretrained(exported(job, params, tmp_path),
                                     torch_dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor(TOKENS)).logits.numpy(), theirs,
                                   atol=1e-5, rtol=0)
    assert_same_greedy_text(back, job, params, TOKENS, name)
