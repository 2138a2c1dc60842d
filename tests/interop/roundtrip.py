"""What the Hugging Face interop tests share: a directory imported onto a
mesh, the logits of the imported weights, and a model exported through
`scripts/export.py` from a checkpoint of them."""

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

import models
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


def exported(job, params, out: Path) -> Path:
    """`params` checkpointed under `out` and exported with `--hf-dir`; the directory."""
    state = job.state_from_params(params)
    writer = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(out / "ckpt")),
                                   job.state_plan.names, writer=True)
    writer.save(0, job.state_plan.saved_form(state), run.checkpoint_meta(job, 0))
    writer.wait()
    p = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint-dir",
                        str(out / "ckpt"), "--hf-dir", str(out / "hf")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return out / "hf"
