"""LoRA adapters trained here load in peft (models/llama/peft.py,
scripts/export.py --peft-dir).

The base is a tiny random LlamaForCausalLM saved by transformers (4 query
heads over 2 key/value heads). zero_jax reads it as the frozen base
(`--model hf:DIR --init-from DIR`) on fsdp=2,tensor=2 at ZeRO-3, trains
rank-4 adapters on every projection for three steps, saves them, and
exports them with --peft-dir: `peft.PeftModel.from_pretrained` on
transformers' base computes zero_jax's logits within 1e-5 (float32), where
the base alone is more than 1e-3 away. Exported merged into the base
(--hf-dir --merge-lora), `from_pretrained` computes peft's own
`merge_and_unload` logits within 1e-5, and ours within 1e-5 of the
logits' largest (merged and unmerged products round apart).
Adapters made by peft
(`get_peft_model`, B made non-zero) and saved with `save_pretrained` import
with --lora-init-from: zero_jax computes peft's logits within 1e-4 (the
tolerance of the base's own import, tests/interop/test_llama_transformers.py),
and trains on from them.

Run by `make test-interop`.
"""

import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="make test-interop installs torch")
transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")
peft = pytest.importorskip("peft", reason="make test-interop installs peft")

import models  # noqa: E402
from tests.helpers import compile_step, make_job  # noqa: E402
from tests.interop.roundtrip import ROOT, logits  # noqa: E402
from zero_jax import run  # noqa: E402
from zero_jax.checkpoint import manager as manager_lib  # noqa: E402
from zero_jax.checkpoint import weights  # noqa: E402
from zero_jax.data import corpus as corpus_lib  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             initializer_range=0.2, rope_theta=10000.0)
TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 24))


def _base(tmp_path):
    """The transformers base, saved, and its logits."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SHAPE, torch_dtype=torch.float32)).eval()
    base.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        return base(torch.tensor(TOKENS)).logits.numpy()


def _job(corpus, tmp_path, **extra):
    return make_job(corpus, devices=jax.devices()[:4], **{
        "model": f"hf:{tmp_path / 'base'}", "init_from": str(tmp_path / "base"),
        "mesh": "fsdp=2,tensor=2", "zero_stage": 3, "precision": "fp32", "lora_rank": 4,
        "lora_alpha": 8.0, "lr": 0.01, "lora_targets": "q,k,v,o,gate,up,down",
        "dir": str(tmp_path / "ckpt"), **extra})


def _steps(job, corpus, state, n):
    step_fn, t = compile_step(job), job.run.train
    for i in range(n):
        state, metrics = step_fn(state, corpus_lib.global_batch(
            corpus, "train", job.run.data.seq_len, t.batch_size, t.seed, step=i,
            sharding=job.state_plan.batch_sharding))
    return state, float(metrics["loss"])


def test_adapters_trained_here_load_in_peft_on_the_transformers_base(corpus, tmp_path):
    base_logits = _base(tmp_path)
    job = _job(corpus, tmp_path)
    state, _, _ = run.initial_state(job, None, [models.hf_loader], print)
    state, _ = _steps(job, corpus, state, 3)
    ours = logits(job, state.model_params, TOKENS)
    writer = manager_lib.Checkpointer(job.run.checkpoint, job.state_plan.names, writer=True)
    writer.save(3, job.state_plan.saved_form(state),
                {**run.checkpoint_meta(job, 3), **weights.base_meta(job, weights.digest(state.frozen))})
    writer.wait()
    p = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint-dir",
                        str(tmp_path / "ckpt"), "--peft-dir", str(tmp_path / "adapters")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    adapted = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base",
                                                      torch_dtype=torch.float32),
        tmp_path / "adapters").eval()
    with torch.no_grad():
        theirs = adapted(torch.tensor(TOKENS)).logits.numpy()
    print(f"LoRA in peft: max |logits difference| {np.abs(ours - theirs).max():.2e}; "
          f"the base alone {np.abs(ours - base_logits).max():.2e} away")
    assert np.abs(ours - base_logits).max() > 1e-3  # the adapters moved the model
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    p = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint-dir",
                        str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "merged"),
                        "--merge-lora", "--dtype", "float32"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged",
                                                           torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = merged(torch.tensor(TOKENS)).logits.numpy()
    with torch.no_grad():
        peft_merged = adapted.merge_and_unload()(torch.tensor(TOKENS)).logits.numpy()
    scale = np.abs(ours).max()
    print(f"merged into the base: max |logits difference| {np.abs(ours - theirs).max():.2e} "
          f"(logits up to {scale:.2f}); from peft's own merge_and_unload "
          f"{np.abs(peft_merged - theirs).max():.2e}, which is itself "
          f"{np.abs(peft_merged - ours).max():.2e} from our unmerged logits")
    np.testing.assert_allclose(theirs, peft_merged, atol=1e-5, rtol=0)  # peft's own merge
    # A merged weight rounds W + s A B once, where the adapters' products round
    # x W and (x A) B apart: float32's floor, a few 1e-6 of the logits' scale.
    np.testing.assert_allclose(theirs, ours, atol=1e-5 * scale, rtol=0)


def test_adapters_made_by_peft_import_and_train_on(corpus, tmp_path):
    _base(tmp_path)
    torch.manual_seed(1)
    made = peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # B starts at zero: made non-zero, so that the adapters show
        for name, p in made.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
        theirs = made.eval()(torch.tensor(TOKENS)).logits.numpy()
    made.save_pretrained(tmp_path / "made")
    job = _job(corpus, tmp_path, lora_init_from=str(tmp_path / "made"))
    state, _, _ = run.initial_state(job, None, [models.hf_loader, models.peft_loader], print)
    ours = logits(job, state.model_params, TOKENS)
    print(f"peft's adapters here: max |logits difference| {np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)  # as the base's own import
    before = jax.tree.map(np.asarray, state.params)
    state, loss = _steps(job, corpus, state, 2)
    assert np.isfinite(loss)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, before)
    assert min(jax.tree.leaves(moved)) > 0  # every adapter trains on
    wrong = _job(corpus, tmp_path, lora_init_from=str(tmp_path / "made"), lora_rank=8)
    with pytest.raises(ValueError, match="r 4 there, 8 here"):
        run.initial_state(wrong, None, [models.hf_loader, models.peft_loader], print)
