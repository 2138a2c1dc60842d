"""The largest GPT-family model one device trains, with and without host offload.

The family is GPT-3's shape at its 6.7B-175B aspect ratio: d_model = 128 x
n_layer, heads of 128, an MLP of 4 d_model, GPT-2's 50,257-token
vocabulary, 2048 positions. For each device kind and offload mode `rows`
finds the most layers whose run fits one device: sequence 2048, micro-batch
1, full remat, the bf16 policy with float32 master weights and Adam moments
(and float32 gradients, or bfloat16 ones). Each mode takes the ZeRO stage
that leaves the fewest bytes on the device (on one device the stage decides
only what is stored in which dtype, and what may be offloaded):

    none        nothing offloaded
    opt         the optimizer state and master weights in host memory
    opt+params  the stored parameters too (ZeRO-3)

From shapes only, as `zero-jax memory` counts them: the model states exact
from the layout's shardings and memory kinds, a step's temporaries from
the planner's estimate (step_bytes.py); nothing is allocated or compiled.
The device must hold its states and the step's largest phase, the host its
offloaded states and the update's gradients.
"""

from __future__ import annotations

import dataclasses

import models
from zero_jax import config as config_lib
from zero_jax.planner import choices, cost
from zero_jax.runtime import device_kinds

VOCAB = 50257
SEQ = 2048
MODES = {"none": ("", (0, 1, 2, 3)), "opt": ("opt", (1, 2, 3)), "opt+params": ("opt+params", (3,))}


def flat(layers: int, stage: int, offload: str, grads: str) -> tuple[dict, choices.Choice]:
    choice = choices.Choice(1, 1, 1, stage, "full", 1, 1, offload=offload)
    base = {"model.name": "", "model.n_layer": layers, "model.n_head": layers,
            "model.d_model": 128 * layers, "model.vocab_size": VOCAB, "model.max_seq_len": SEQ,
            "precision.policy": "bf16", "data.seq_len": SEQ, "train.batch_size": 1,
            "parallel.mesh": "fsdp=1", "precision.grad_dtype": grads}
    out = choice.flat(base)
    out["model.vocab_multiple"] = 1
    return out, choice


def estimate(device: device_kinds.Device, layers: int, stage: int, offload: str,
             grads: str) -> cost.Estimate:
    run_flat, choice = flat(layers, stage, offload, grads)
    build = models.for_run(config_lib.build(None, run_flat).model, VOCAB)[0]
    job = choices.abstract_job(run_flat, build, 1)
    return cost.estimate(job, choice, choices.Cluster(device, 1, 1))


def largest(device: device_kinds.Device, offload: str, stage: int,
            grads: str) -> tuple[int, cost.Estimate]:
    """The most layers that fit (fitting is monotone in the layer count)."""
    def fits(n):
        return estimate(device, n, stage, offload, grads).fits
    if not fits(1):
        return 0, estimate(device, 1, stage, offload, grads)
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, estimate(device, lo, stage, offload, grads)


def row(kind: str, device: device_kinds.Device, mode: str, grads: str) -> dict:
    """The largest model of one device kind in one offload mode, with its bytes."""
    offload, stages = MODES[mode]
    layers, est, stage = max((largest(device, offload, s, grads) + (s,) for s in stages),
                             key=lambda t: t[0])
    model = config_lib.build(None, flat(layers, stage, offload, grads)[0]).model
    params = models.for_run(model, VOCAB)[0](1).config.param_count
    stored = {k: est.memory.state[k] - est.memory.host.get(k, 0) for k in ("params", "grads", "opt_state")}
    return {"device": kind, "offload": mode, "zero_stage": stage, "n_layer": layers,
            "d_model": 128 * layers, "params": params,
            "device_bytes_per_param": sum(stored.values()) / params,
            "host_bytes_per_param": sum(est.memory.host.values()) / params,
            "device_states": stored, "host_states": est.memory.host,
            "step_peak_bytes": max(est.memory.phases.values()),
            "device_total_bytes": est.memory.device_bytes, "hbm_bytes": est.hbm,
            "host_total_bytes": est.memory.host_bytes, "host_limit_bytes": est.host_limit,
            "step_s_estimate": est.time.step_s}


def devices(kinds: list[str], host_bytes: float) -> list[tuple[str, device_kinds.Device]]:
    """The device kinds by name, each with `host_bytes` of host memory. A
    ValueError for a kind that is not known or has no host link figures."""
    out = []
    for kind in kinds:
        device = device_kinds.load(kind)
        if not device.can_offload:
            raise ValueError(f"{kind} has no host link figures (meshes/devices/{kind}.toml)")
        out.append((kind, dataclasses.replace(device, host_bytes_per_node=int(host_bytes))))
    return out


def rows(kinds: list[tuple[str, device_kinds.Device]], grads: str) -> list[dict]:
    """A row for each device kind and offload mode, in that order."""
    return [row(kind, device, mode, grads) for kind, device in kinds for mode in MODES]


def table(found: list[dict], grads: str, host_bytes: float) -> list[str]:
    """The rows as a table, after a line saying what was assumed."""
    out = [f"GPT family d_model = 128 x layers, seq {SEQ}, micro-batch 1, full remat, bf16 with "
           f"float32 masters and Adam, {grads} gradients; one device, "
           f"{host_bytes / 1e12:g} TB host memory; bytes per parameter exact from the "
           f"shardings, device GB adds the step's estimated temporaries",
           f"{'device':<12}{'offload':<12}{'ZeRO':>5}{'layers':>7}{'params':>9}"
           f"{'device B/param':>16}{'host B/param':>14}{'device GB':>11}{'host GB':>9}{'step s':>8}"]
    for r in found:
        out.append(f"{r['device']:<12}{r['offload']:<12}{r['zero_stage']:>5}{r['n_layer']:>7}"
                   f"{r['params'] / 1e9:>8.1f}B{r['device_bytes_per_param']:>16.2f}"
                   f"{r['host_bytes_per_param']:>14.2f}{r['device_total_bytes'] / 1e9:>11.1f}"
                   f"{r['host_total_bytes'] / 1e9:>9.1f}{r['step_s_estimate']:>8.1f}")
    return out
