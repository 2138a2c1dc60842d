"""FLOPs per token, the peak they are measured against, and MFU.

Model FLOPs per token are the model's own formula, 6 N + 12 L H Q T (PaLM,
appendix B; the attention term is the full T x T product, not halved for
the causal mask, as XLA computes it). Hardware FLOPs add what the
activation-checkpointing policy recomputes in the backward pass: each model
describes one block as a small graph of `Op`s, and `recomputed` walks it
under the policy (what the backward needs that was not kept is rebuilt from
the nearest kept tensor). MFU = tokens/s x model FLOPs per token / (devices x
peak); HFU the same with hardware FLOPs.

The peak is the device's, from meshes/devices/ (datasheet figures with their
sources), in the dtype the matmuls run in; on CPU it is the host's, probed by
a matmul and cached (cpu_peak.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from zero_jax.analysis import cpu_peak as cpu_peak_lib
from zero_jax.runtime import cpu
from zero_jax.runtime import distributed
from zero_jax.model.contract import Op
from zero_jax.runtime.device_kinds import for_device_kind


def recomputed(ops: Sequence[Op], kept: Callable[[Op], bool]) -> float:
    """Forward FLOPs per token one block recomputes in its backward pass
    when only the tensors `kept` selects (and the block input) are kept."""
    by_key = {op.key: op for op in ops}
    rebuilt: set[str] = set()

    def need(key: str) -> None:
        if key == "x" or key in rebuilt or kept(by_key[key]):
            return
        rebuilt.add(key)
        for k in by_key[key].inputs:
            need(k)

    for op in ops:
        for key in op.backward_reads():
            need(key)
    return float(sum(by_key[k].flops for k in rebuilt))


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """Training FLOPs per token of one run: the model's, and with recompute."""

    model: float  # 6 N + attention, per token
    hardware: float  # model + what remat recomputes, per token

    @classmethod
    def of(cls, model_fns, seq_len: int, remat) -> "StepFlops":
        model = model_fns.flops_per_token(seq_len)
        if model_fns.block_ops is None or remat.policy == "none":
            return cls(model, model)
        extra = model_fns.layers * recomputed(model_fns.block_ops(seq_len), remat.keeps)
        return cls(model, model + extra)


@dataclasses.dataclass(frozen=True)
class Peak:
    """Dense matmul FLOP/s of one device in one dtype, and where it is from."""

    flops: float
    source: str
    probed_dtype: str = ""  # a CPU host's probe (cpu_peak.py), in this dtype; "": a datasheet's


def device_peak(device: jax.Device, compute_dtype: str, sharing: int | None = None) -> Peak | None:
    """The peak of `device` for matmuls in `compute_dtype`: the datasheet's
    for a known accelerator, None if unknown; on CPU the probe's host peak
    over the `sharing` devices that run on its cores (default: every device
    of every process on this host)."""
    if device.platform == "cpu":
        return cpu_peak(compute_dtype,
                        sharing or jax.local_device_count() * processes_on_this_host())
    kind = for_device_kind(device.device_kind)
    if kind is None:
        return None
    if jnp.dtype(compute_dtype).itemsize == 2:
        return Peak(kind.peak_flops, f"{kind.name} dense 16-bit peak (meshes/devices)")
    return Peak(kind.peak_flops_fp32, f"{kind.name} float32 matmul peak as JAX runs it by "
                                      "default (meshes/devices)")


def processes_on_this_host() -> int:
    """Processes sharing this host's cores: all of a `zero-jax launch` run
    (it starts them on one machine and says so in each), else this one."""
    if os.environ.get(cpu.ENV_LAUNCHED):
        return int(os.environ.get(distributed.ENV_NUM_PROCESSES, "1"))
    return 1


def cpu_peak(dtype: str, local_devices: int) -> Peak:
    """Per-device peak on CPU: this host's probed matmul FLOP/s (cpu_peak.py),
    shared by its `local_devices` simulated devices (those of every process
    on the host), which run on the same cores."""
    probe, cache = cpu_peak_lib.peak(dtype)
    return Peak(probe.flops / local_devices,
                f"{probe.describe(dtype)} (cached in {cache}), shared by {local_devices} "
                "device(s)", probed_dtype=dtype)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Turns tokens/s into FLOP/s per device and utilisation."""

    flops: StepFlops
    devices: int
    peak: Peak | None

    def fields(self, tokens_per_s: float) -> dict[str, float]:
        model = tokens_per_s * self.flops.model / self.devices
        hardware_ = tokens_per_s * self.flops.hardware / self.devices
        out = {"model_tflops_per_device": model / 1e12,
               "hardware_tflops_per_device": hardware_ / 1e12}
        if self.peak is not None and self.peak.flops > 0:
            # A step that did more than the peak shows the peak too low (a
            # probe slowed by other work): what the step did bounds it.
            peak = max(self.peak.flops, hardware_)
            out.update(mfu=model / peak, hfu=hardware_ / peak)
        return out

    def check_peak(self, history: Sequence[dict]) -> None:
        """After a run: a probed peak that a step exceeded is probed again by
        the next run."""
        if self.peak is None or not self.peak.probed_dtype:
            return
        done = max((r.get("hardware_tflops_per_device", 0.0) * 1e12 for r in history), default=0.0)
        if done > self.peak.flops:
            cpu_peak_lib.reprobe_next_run(self.peak.probed_dtype)


def throughput(job) -> Throughput:
    """The throughput figures of `job`'s train step over the devices of its
    mesh (on CPU, those of this process share the host's peak, with those of
    the other processes on the host)."""
    flops = StepFlops.of(job.model, job.run.data.seq_len, job.hooks.remat)
    devices = list(job.state_plan.mesh.devices.flat)
    local = sum(d.process_index == jax.process_index() for d in devices)
    return Throughput(flops, len(devices),
                      device_peak(devices[0], job.policy.compute,
                                  local * processes_on_this_host()))


def describe(t: Throughput) -> str:
    """One line for the plan: FLOPs per token and the peak MFU is taken against."""
    f = t.flops
    line = f"FLOPs/token: model {f.model / 1e6:,.1f} M"
    if f.hardware != f.model:
        line += f", hardware {f.hardware / 1e6:,.1f} M (with recompute)"
    if t.peak is None:
        return line + "; no peak known for this device: MFU not reported"
    return line + f"; MFU against {t.peak.flops / 1e12:,.3g} TFLOP/s per device ({t.peak.source})"

