"""LoRA's cost as the job and the planner count it: its FLOPs against the
compiled step's products, and the planner's answer for Llama-2-70B on one
node of 8 x 80 GB, where a full fine-tune does not fit."""

import json

import jax
import numpy as np
import pytest

from tests.helpers import make_job
from zero_jax.analysis import memory
from zero_jax.analysis.dot_flops import dot_flops
from zero_jax.cli import plan

ONE = dict(model="llama-tiny", precision="fp32", mesh="fsdp=1", zero_stage=0, remat="none")


def test_lora_flops_leave_out_the_base_weight_gradients(corpus):
    """The compiled one-device step's matrix products, LoRA against a full
    fine-tune, shrink as the FLOPs per token the jobs count (4 N + 6 n +
    attention against 6 N + attention) to 2%. (On llama-tiny, whose
    adapters are 5% of its parameters, the step runs about 2 |A| per
    token and adapter beyond the 6 n counted: 1.1%.)"""
    def flops(**extra):
        job = make_job(corpus, devices=jax.devices()[:1], **ONE, **extra)
        ran = dot_flops(job.lower_train_step().compile().as_text(), job.model.layers)
        return ran, job.model.flops_per_token(job.run.data.seq_len)
    full_ran, full_counted = flops()
    lora_ran, lora_counted = flops(lora_rank=8, lora_targets="q,k,v,o,gate,up,down")
    print(f"\nproducts run: LoRA / full {lora_ran / full_ran:.4f}; counted "
          f"{lora_counted / full_counted:.4f}")
    assert lora_ran < 0.75 * full_ran
    assert abs((lora_ran / full_ran) / (lora_counted / full_counted) - 1) < 0.02


def _plan(capsys, *extra) -> tuple[int, dict]:
    code = plan.main(["--model", "llama-2-70b", "--cluster", "a100-80gb", "--nodes", "1",
                      "--global-batch", "32", "--seq-len", "4096", "--compile", "0", "--json",
                      "--stages", "3", "--micro", "1", "--offload", "none", "--quantized", "off",
                      *extra])
    return code, json.loads(capsys.readouterr().out)


def test_the_planner_fits_a_70b_lora_on_one_node_with_its_headroom(capsys, corpus):
    """Llama-2-70B on 8 x A100-80GB: no full fine-tune layout fits (exit 3);
    LoRA rank 16 on every projection does, its frozen base counted in the
    stored parameters as the memory report counts it, with headroom > 0."""
    code, full = _plan(capsys)
    assert code == plan.NOTHING_FITS and full["fitting"] == 0
    code, lora = _plan(capsys, "--lora-rank", "16", "--lora-targets", "q,k,v,o,gate,up,down")
    assert code == 0 and lora["fitting"] > 0
    top = lora["top"][0]
    assert top["fits"] and top["headroom"] > 0 and top["layout"].startswith("PP=1")
    tensor = int(top["layout"].split("TP=")[1].split()[0])
    report = make_job(corpus, model="llama-2-70b", precision="bf16", mesh=f"fsdp={8 // tensor},"
                      f"tensor={tensor}", zero_stage=3, lora_rank=16,
                      lora_targets="q,k,v,o,gate,up,down", seq_len=4096, batch_size=32,
                      devices=jax.devices()[:8])
    assert top["bytes"]["params"] == pytest.approx(memory.sharded(report.state_plan)["params"],
                                                   rel=1e-6)
    # the base at 2 bytes a parameter over the 8 devices, the adapters besides
    assert np.isclose(top["bytes"]["params"], 2 * 68.98e9 / 8, rtol=0.02)
