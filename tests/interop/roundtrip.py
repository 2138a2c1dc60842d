"""What the Hugging Face interop tests share: a directory imported onto a
mesh, the logits of the imported weights, a model exported through
`scripts/export.py` from a checkpoint of them, and its greedy text against
ours."""

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

import models
from tests import generate
from tests.helpers import make_job
from zero_jax import run
from zero_jax.checkpoint import manager as manager_lib

ROOT = Path(__file__).resolve().parents[2]


def imported(corpus, directory, mesh, n_devices):
    """The job of `--model hf:directory` on `mesh` (ZeRO-3) and its weights."""
    job = make_job(corpus, model=f"hf:{directory}", mesh=mesh, zero_stage=3,
                   devices=jax.devices()[:n_devices])
    return job, run.load_params(str(directory), job, loaders=[models.hf_loader])


def logits(job, params, tokens):
    return np.asarray(jax.jit(lambda p, t: job.model.logits(p, t, job.hooks))(params, tokens))


def exported(job, params, out: Path, *flags: str) -> Path:
    """`params` checkpointed under `out` and exported with `--hf-dir` (and
    `flags`); the directory."""
    state = job.state_from_params(params)
    writer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(out / "ckpt")),
                                   job.state_plan.names, writer=True)
    writer.save(0, job.state_plan.saved_form(state), run.checkpoint_meta(job, 0))
    writer.wait()
    p = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint-dir",
                        str(out / "ckpt"), "--hf-dir", str(out / "hf"), *flags],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return out / "hf"


def assert_same_greedy_text(back, job, params, tokens, name: str, prompt: int = 8,
                            new: int = 20) -> None:
    """`generate`'s `new` greedy tokens from transformers' model `back` after
    the first `prompt` tokens of each row equal zero_jax's greedy decode."""
    import torch
    start = torch.tensor(tokens[:, :prompt])
    with torch.no_grad():
        text = back.generate(start, max_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones_like(start), pad_token_id=0)
    ours = generate.greedy(lambda p, t: job.model.logits(p, t, job.hooks), params,
                           tokens[:, :prompt], new)
    print(f"{name}: greedy tokens {ours[0].tolist()}")
    np.testing.assert_array_equal(text[:, prompt:].numpy(), ours)
