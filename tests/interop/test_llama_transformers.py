"""Llama-family checkpoints written by transformers import into zero_jax and
export back (models/hf.py, scripts/export.py).

For each of LlamaForCausalLM (4 query heads over 2 key/value heads),
MistralForCausalLM and Qwen2ForCausalLM (q/k/v biases, tied head), built by
transformers from a small config with random weights and saved with
`save_pretrained` (no hub access):
  - the import computes transformers' logits, float32, within 1e-4, on one
    device and on fsdp=2,tensor=2 with ZeRO-3, and reads a sharded directory
    (small `max_shard_size`) to the same bits;
  - export -> `from_pretrained` gives transformers' logits exactly, and
    `generate`'s 20 greedy tokens equal zero_jax's greedy decode.

Run by `make test-interop`.
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="make test-interop installs torch")
transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")

from tests.helpers import host  # noqa: E402
from tests.interop.roundtrip import exported, imported, logits  # noqa: E402
from zero_jax import generate  # noqa: E402
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             initializer_range=0.2)  # wide enough that greedy text varies
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(rope_theta=1e6, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False)),
}
TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 24))


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def saved(request, tmp_path_factory):
    """A randomly initialised transformers model, saved whole and sharded."""
    config_cls, model_cls, extra = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **extra, torch_dtype=torch.float32)).eval()
    with torch.no_grad():  # non-zero biases, so that a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    tmp = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(tmp / "whole")
    model.save_pretrained(tmp / "sharded", max_shard_size="100KB")
    with torch.no_grad():
        expected = model(torch.tensor(TOKENS)).logits.numpy()
    return request.param, model_cls, model, expected, tmp


@pytest.mark.parametrize("mesh,n", [("data=1", 1), ("fsdp=2,tensor=2", 4)])
def test_imported_weights_compute_transformers_logits(corpus, saved, mesh, n):
    name, _, _, theirs, tmp = saved
    job, params = imported(corpus, tmp / "whole", mesh, n)
    ours = logits(job, params, TOKENS)
    print(f"{name} on {mesh}: max |logits difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    files = sorted(p.name for p in (tmp / "sharded").glob("*.safetensors"))
    assert len(files) > 1
    _, from_shards = imported(corpus, tmp / "sharded", mesh, n)
    jax.tree.map(np.testing.assert_array_equal, host(from_shards), host(params))


def test_export_loads_in_transformers_and_generates_the_same_text(corpus, saved, tmp_path):
    name, model_cls, model, theirs, tmp = saved
    job, params = imported(corpus, tmp / "whole", "data=1", 1)
    back = model_cls.from_pretrained(exported(job, params, tmp_path),
                                     torch_dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(back(torch.tensor(TOKENS)).logits.numpy(), theirs)
        prompt = torch.tensor(TOKENS[:, :8])
        text = back.generate(prompt, max_new_tokens=20, do_sample=False,
                             attention_mask=torch.ones_like(prompt), pad_token_id=0)
    ours = generate.greedy(lambda p, t: job.model.apply(p, t, job.hooks), params,
                           TOKENS[:, :8], 20)
    print(f"{name}: greedy tokens {ours[0].tolist()}")
    np.testing.assert_array_equal(text[:, 8:].numpy(), ours)
