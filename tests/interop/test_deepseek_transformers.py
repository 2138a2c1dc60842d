"""DeepSeek-V3 checkpoints written by transformers import into zero_jax and
export back (models/llama/deepseek_hf.py, scripts/export.py).

A tiny DeepseekV3ForCausalLM built by transformers with random weights:
latent attention with both compressions and YaRN, 2 dense layers then 2
mixtures (8 experts in 4 groups, a token's 2 from its best 2 groups, a
shared expert, sigmoid scores scaled by 2.5) and a random correction bias,
saved with `save_pretrained`:
  - the import computes transformers' logits, float32, within 1e-5, on one
    device and on expert=2,fsdp=2,tensor=2 with ZeRO-3 (dropless);
  - export -> `from_pretrained` gives the same logits, and `generate`'s 20
    greedy tokens equal zero_jax's greedy decode;
  - fine-tuned three steps (the bias moving too), exported and reloaded by
    `from_pretrained`, transformers computes our logits within 1e-5.

Run by `make test-interop`.
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="make test-interop installs torch")
transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")

import models  # noqa: E402
from tests.helpers import compile_step, make_job  # noqa: E402
from tests.interop.roundtrip import (  # noqa: E402
    assert_same_greedy_text, exported, imported, logits)
from zero_jax import run  # noqa: E402
from zero_jax.data import corpus as corpus_lib  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
             qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2,
             first_k_dense_replace=2, norm_topk_prob=True, max_position_embeddings=64,
             initializer_range=0.1,  # wide enough that greedy text and routing vary
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                           "original_max_position_embeddings": 16, "mscale": 1.0,
                           "mscale_all_dim": 1.0})
TOKENS = np.random.default_rng(0).integers(0, 256, size=(4, 24))  # 4 rows: the mesh splits them


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A randomly initialised DeepseekV3ForCausalLM with a random correction bias, saved."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**SHAPE, torch_dtype=torch.float32)).eval()
    for layer in model.model.layers[SHAPE["first_k_dense_replace"]:]:
        layer.mlp.gate.e_score_correction_bias.data = torch.randn(8) * 0.05
    tmp = tmp_path_factory.mktemp("deepseek")
    model.save_pretrained(tmp / "whole")
    with torch.no_grad():
        expected = model(torch.tensor(TOKENS)).logits.numpy()
    return model, expected, tmp


@pytest.mark.parametrize("mesh,n", [("data=1", 1), ("expert=2,fsdp=2,tensor=2", 8)])
def test_imported_weights_compute_transformers_logits(corpus, saved, mesh, n):
    _, theirs, tmp = saved
    job, params = imported(corpus, tmp / "whole", mesh, n)
    assert job.model.config.mla and job.model.config.first_k_dense_replace == 2
    ours = logits(job, params, TOKENS)
    print(f"deepseek_v3 on {mesh}: max |logits difference| {np.abs(ours - theirs).max():.2e} "
          f"(logits up to {np.abs(theirs).max():.2f})")
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_export_loads_in_transformers_and_generates_the_same_text(corpus, saved, tmp_path):
    _, theirs, tmp = saved
    job, params = imported(corpus, tmp / "whole", "data=1", 1)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(
        exported(job, params, tmp_path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor(TOKENS)).logits.numpy(), theirs,
                                   atol=1e-5, rtol=0)
    assert_same_greedy_text(back, job, params, TOKENS, "deepseek_v3")


def test_fine_tuned_export_reloads_in_transformers(corpus, saved, tmp_path):
    """Three steps from the imported weights with the bias update on, then
    exported: transformers computes the fine-tuned model's logits."""
    _, _, tmp = saved
    job = make_job(corpus, model=f"hf:{tmp / 'whole'}", mesh="data=1", zero_stage=3,
                   devices=jax.devices()[:1], precision="fp32", seq_len=32, batch_size=8,
                   router_bias_update_rate=0.01)
    before = run.load_params(str(tmp / "whole"), job, loaders=[models.hf_loader])
    state, step_fn, t = job.state_from_params(before), compile_step(job), job.run.train
    for i in range(3):
        state, _ = step_fn(state, corpus_lib.global_batch(
            corpus, "train", 32, 8, t.seed, step=i, sharding=job.state_plan.batch_sharding))
    params = job.state_plan.saved_form(state).params
    moved = np.abs(np.asarray(params["blocks"]["moe"]["expert_bias"])
                   - np.asarray(before["blocks"]["moe"]["expert_bias"])).max()
    assert moved > 0.005  # the bias moved, by the rate a step
    ours = logits(job, params, TOKENS)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(
        exported(job, params, tmp_path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = back(torch.tensor(TOKENS)).logits.numpy()
    print(f"deepseek_v3 fine-tuned: max |logits difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_deepseek_files_mtp_layer_imports_into_the_mtp_module(corpus, saved, tmp_path):
    """DeepSeek's own files hold the MTP module as layer n_layer (a mixture
    layer with enorm, hnorm, eh_proj and shared_head.norm); transformers'
    do not. Written as DeepSeek's are, each tensor lands in its place, and
    `export --with-mtp` writes every one back bit for bit (with copies of
    the embedding and head in that layer), which `from_pretrained` loads,
    computing the model's logits; a directory without it is refused naming
    --mtp-depth 0."""
    from safetensors.numpy import load_file, save_file
    _, _, tmp = saved
    files = load_file(str(tmp / "whole" / "model.safetensors"))
    rng = np.random.default_rng(1)
    L, D = SHAPE["num_hidden_layers"], SHAPE["hidden_size"]
    mtp = {k.replace(f"layers.{L - 1}.", f"layers.{L}."): rng.normal(size=v.shape).astype(v.dtype)
           for k, v in files.items() if f"layers.{L - 1}." in k}
    mtp.update({f"model.layers.{L}.{n}": rng.normal(size=s).astype(np.float32) for n, s in (
        ("enorm.weight", (D,)), ("hnorm.weight", (D,)), ("eh_proj.weight", (D, 2 * D)),
        ("shared_head.norm.weight", (D,)))})
    theirs = tmp_path / "deepseek"
    theirs.mkdir()
    save_file({**files, **mtp}, str(theirs / "model.safetensors"), metadata={"format": "pt"})
    (theirs / "config.json").write_text((tmp / "whole" / "config.json").read_text())
    job = make_job(corpus, model=f"hf:{theirs}", mtp_depth=1, mesh="data=1", zero_stage=3,
                   devices=jax.devices()[:1])
    params = jax.tree.map(np.asarray, run.load_params(str(theirs), job,
                                                      loaders=[models.hf_loader]))
    m = params["mtp_0"]
    np.testing.assert_array_equal(m["w_eh"], mtp[f"model.layers.{L}.eh_proj.weight"].T)
    np.testing.assert_array_equal(m["norm"]["scale"], mtp[f"model.layers.{L}.shared_head.norm.weight"])
    np.testing.assert_array_equal(m["block"]["moe"]["w_experts_down"][3],
                                  mtp[f"model.layers.{L}.mlp.experts.3.down_proj.weight"].T)
    np.testing.assert_array_equal(m["block"]["moe"]["expert_bias"],
                                  mtp[f"model.layers.{L}.mlp.gate.e_score_correction_bias"])
    back = exported(job, params, tmp_path / "export", "--with-mtp")
    written = load_file(str(back / "model.safetensors"))
    copies = {f"model.layers.{L}.embed_tokens.weight": files["model.embed_tokens.weight"],
              f"model.layers.{L}.shared_head.head.weight": files["lm_head.weight"]}
    assert set(written) == {*files, *mtp, *copies}
    for name, value in {**files, **mtp, **copies}.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    assert json.loads((back / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        back, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(model(torch.tensor(TOKENS)).logits.numpy(), saved[1],
                                   atol=1e-5, rtol=0)
    job = make_job(corpus, model=f"hf:{tmp / 'whole'}", mtp_depth=1, mesh="data=1",
                   zero_stage=3, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="--mtp-depth 0"):
        run.load_params(str(tmp / "whole"), job, loaders=[models.hf_loader])
