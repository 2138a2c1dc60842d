"""The Hugging Face export loads in `transformers` and computes our logits.

Run by `make test-interop`, which installs transformers and a CPU build of
torch in a separate environment; `make test` leaves this directory out.
"""

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="make test-interop installs torch")
transformers = pytest.importorskip("transformers", reason="make test-interop installs transformers")

import models  # noqa: E402
from tests.helpers import host, make_job, train  # noqa: E402
from zero_jax import run  # noqa: E402
from zero_jax.checkpoint import manager as manager_lib
from zero_jax.model.hooks import Hooks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exported(corpus, tmp_path_factory):
    """A few trained steps of gpt-tiny (so every bias is non-zero), saved and exported."""
    tmp = tmp_path_factory.mktemp("hf")
    job = make_job(corpus, steps=3)
    _, state = train(job, corpus)
    c = manager_lib.Checkpointer(manager_lib.CheckpointConfig(dir=str(tmp / "ckpt")), job.state_plan.names,
                              writer=True)
    c.save(3, state, run.checkpoint_meta(job, 3))
    c.wait()
    p = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint-dir", str(tmp / "ckpt"),
                        "--hf-dir", str(tmp / "hf")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return job, host(state.params), tmp / "hf"


def test_transformers_logits_match_ours(exported):
    job, params, hf_dir = exported
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 24))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(job.model.apply(params, tokens, Hooks()))
    assert theirs.shape == ours.shape
    print(f"max |logits difference| vs transformers: {np.abs(theirs - ours).max():.2e}")
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


def test_hugging_face_weights_import_back_exactly(exported):
    job, params, hf_dir = exported
    imported = run.load_params(str(hf_dir), job, loaders=[models.hf_loader])
    jax.tree.map(np.testing.assert_array_equal, host(imported), params)
