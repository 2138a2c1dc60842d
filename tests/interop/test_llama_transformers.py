"""Llama-family checkpoints written by transformers import into zero_jax and
export back (models/common/hf_files.py, models/llama/hf.py,
scripts/export.py).

For each of LlamaForCausalLM (4 query heads over 2 key/value heads),
MistralForCausalLM and Qwen2ForCausalLM (q/k/v biases, tied head), built by
transformers from a small config with random weights and saved with
`save_pretrained` (no hub access):
  - the import computes transformers' logits, float32, within 1e-4, on one
    device and on fsdp=2,tensor=2 with ZeRO-3, and reads a sharded directory
    (small `max_shard_size`) to the same bits;
  - export -> `from_pretrained` gives transformers' logits exactly, and
    `generate`'s 20 greedy tokens equal zero_jax's greedy decode;
  - a bf16 llama-tiny run exports bf16, and its logits agree with
    transformers' in bf16 and, from the same bf16 weights, in float32.

Run by `make test-interop`.
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="make test-interop installs torch")
transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")

from tests.helpers import host, initial_state, make_job  # noqa: E402
from tests.interop.roundtrip import (  # noqa: E402
    assert_same_greedy_text, exported, imported, logits)
from zero_jax.checkpoint import export  # noqa: E402
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
    assert_same_greedy_text(back, job, params, TOKENS, name)


@pytest.fixture(scope="module")
def bf16_export(corpus, tmp_path_factory):
    """The state of a llama-tiny run that stores bfloat16 parameters,
    checkpointed and exported with --hf-dir (its default dtype)."""
    job = make_job(corpus, model="llama-tiny", precision="bf16", param_dtype="bfloat16",
                   opt_state_dtype="bfloat16", mesh="fsdp=2", devices=jax.devices()[:2])
    params = job.state_plan.saved_form(initial_state(job)).params
    return job, params, exported(job, params, tmp_path_factory.mktemp("bf16"))


def test_a_bf16_run_exports_bf16_and_transformers_computes_its_logits(corpus, bf16_export):
    """The export is bf16 (safetensors header, config.json's torch_dtype).
    Both evaluating in float32 from the same bf16 weights, the logits agree
    to 1e-5. `from_pretrained` in bfloat16 computes our bf16 logits to 1e-2
    of the logits' scale: two bf16 programs round in different places (each
    is about 1e-2 from the float32 logits at worst, apart by as much), and
    ours errs no more than transformers' own."""
    job, params, hf_dir = bf16_export
    header = export.SafetensorsFile(hf_dir / "model.safetensors").header
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model_cls = transformers.LlamaForCausalLM

    job32, params32 = imported(corpus, hf_dir, "data=1", 1)  # float32 on CPU, from the bf16 file
    assert {x.dtype for x in jax.tree.leaves(params32)} == {np.dtype("float32")}
    ours32 = logits(job32, params32, TOKENS)
    with torch.no_grad():
        theirs32 = model_cls.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()(
            torch.tensor(TOKENS)).logits.numpy()
    print(f"float32 from the bf16 weights: max |logits difference| "
          f"{np.abs(ours32 - theirs32).max():.2e}")
    np.testing.assert_allclose(ours32, theirs32, atol=1e-5, rtol=0)

    ours = logits(job, params, TOKENS).astype(np.float32)
    with torch.no_grad():
        theirs = model_cls.from_pretrained(hf_dir, torch_dtype=torch.bfloat16).eval()(
            torch.tensor(TOKENS)).logits.float().numpy()
    scale = np.abs(theirs32).max()
    assert scale > 0.5, "logits too small for the bound to mean anything"
    apart, ours_off, theirs_off = (np.abs(a - b).max() for a, b in
                                   ((ours, theirs), (ours, theirs32), (theirs, theirs32)))
    print(f"bf16: max |logits difference| {apart:.2e} (logits up to {scale:.2f}); from the "
          f"float32 logits: ours {ours_off:.2e}, transformers' {theirs_off:.2e}")
    assert apart <= 1e-2 * scale
    assert ours_off <= 1.25 * theirs_off
