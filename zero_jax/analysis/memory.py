"""Bytes per device of the model states, three ways that must agree.

1. `theory`: the ZeRO paper's formula (arXiv:1910.02054), from the parameter
   count and the bytes per parameter of parameters, gradients and optimizer
   state under the precision policy: stage s divides the states it shards by
   the ZeRO degree N_d, and tensor parallelism divides every state by t.
2. `sharded`: the bytes of the actual shardings, summed over leaves.
3. `compiled`: the compiled train step's `memory_analysis()`.

Activations are reported beside them: the model's analytic estimate for the
remat policy, and the compiled step's temporary bytes.

`check_fits` refuses, before anything is compiled or allocated, a run whose
model states alone (the `sharded` bytes) exceed a device's memory or what
the host has left.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from zero_jax.model import base_quant
from zero_jax.sharding import offload as offload_lib
from zero_jax.analysis.traffic import CollectiveReport
from zero_jax.runtime import procmem
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.specs import bytes_per_device, nbytes, shard_elements, spec_leaves
from zero_jax.train.state import StatePlan

STATES = ("params", "grads", "opt_state")  # the keys of every {state: bytes} figure here


def _nbytes(leaf) -> int:
    return nbytes(math.prod(leaf.shape), leaf.dtype)


def stored_count(state_plan: StatePlan) -> int:
    """Parameters stored, a pipeline's padding slots (pipeline/cut.py) included."""
    return sum(math.prod(p.shape) for p in jax.tree.leaves(state_plan.abstract.params))


def param_count(state_plan: StatePlan) -> int:
    """The model's parameters, LoRA's frozen base included."""
    return trained_count(state_plan) + sum(  # a quantized weight's codes, not its scales
        math.prod(p.shape) for p in jax.tree.leaves(base_quant.full(state_plan.abstract.frozen)))


def trained_count(state_plan: StatePlan) -> int:
    """The parameters the optimizer trains: every one, or LoRA's adapters."""
    stages = state_plan.stages
    if stages is None:
        return stored_count(state_plan)
    return sum(math.prod(p.shape[1:]) * stages.layers if stacked else math.prod(p.shape)
               for p, stacked in zip(jax.tree.leaves(state_plan.abstract.params),
                                     jax.tree.leaves(state_plan.stacked[0])))


def expert_count(state_plan: StatePlan) -> int:
    """Parameters stored in a mixture of experts' stacked experts (the
    arrays with an `experts` dimension)."""
    return sum(math.prod(p.shape) for p, n in zip(jax.tree.leaves(state_plan.abstract.params),
                                                  spec_leaves(state_plan.names))
               if "experts" in tuple(n))


def _divisors(state_plan: StatePlan) -> tuple[int, int]:
    """What ZeRO divides a sharded state by: (dense parameters: every ZeRO
    axis; experts: the expert axis, which splits them anyway, times the
    other ZeRO axes)."""
    sizes = state_plan.mesh_shape.sizes
    axes = state_plan.mesh_shape.shard_axes
    ep = sizes.get("expert", 1)
    return math.prod(sizes[a] for a in axes), ep * math.prod(sizes[a] for a in axes
                                                           if a != "expert")


def bytes_per_param(state_plan: StatePlan) -> dict[str, float]:
    """Model-state bytes per stored parameter: dtype sizes, and the optimizer's per-parameter bytes."""
    psi = stored_count(state_plan)
    opt = sum(_nbytes(x) for x in jax.tree.leaves(state_plan.abstract.opt_state) if x.shape)
    params = sum(_nbytes(p) for p in jax.tree.leaves(state_plan.abstract.params))
    return {"params": params / psi, "grads": np.dtype(state_plan.grad_dtype).itemsize,
            "opt_state": opt / psi}


def divisor(state_plan: StatePlan, sharded: bool, expert: bool) -> int:
    """What the ZeRO formula divides a parameter's state by: the tensor
    degree t, times every ZeRO axis where the stage shards it; an expert's,
    the expert axis whatever the stage, times the other ZeRO axes where
    sharded."""
    n_shard, n_expert = _divisors(state_plan)
    sizes = state_plan.mesh_shape.sizes
    if expert:
        return (n_expert if sharded else sizes.get("expert", 1)) * sizes["tensor"]
    return (n_shard if sharded else 1) * sizes["tensor"]


def theory(state_plan: StatePlan) -> dict[str, float]:
    """The ZeRO formula: bytes per parameter x Psi / (N_d if sharded) / t.

    t is the tensor-parallel degree. A mixture of experts' Psi_e expert
    parameters are split over the expert axis (e) whatever the stage, and
    ZeRO shards them over the other ZeRO axes (N_d / e, DeepSpeed-MoE's
    expert-data-parallel group): Psi_e / (e (N_d / e if sharded)) / t.
    Scalar optimizer leaves (step counts) are never sharded and are counted
    in full.
    """
    stage = zero_lib.stage(state_plan.zero_stage)
    psi, psi_e = stored_count(state_plan), expert_count(state_plan)
    per = bytes_per_param(state_plan)
    scalars = sum(_nbytes(x) for x in jax.tree.leaves(state_plan.abstract.opt_state) if not x.shape)

    def share(sharded):  # parameters per device before the bytes per parameter
        return ((psi - psi_e) / divisor(state_plan, sharded, False)
                + psi_e / divisor(state_plan, sharded, True))
    return {
        "params": per["params"] * share(stage.params) + _frozen_bytes(state_plan) / divisor(
            state_plan, stage.params, False),
        "grads": per["grads"] * share(stage.grads),
        "opt_state": per["opt_state"] * share(stage.opt_state) + scalars,
    }


def _frozen_bytes(state_plan: StatePlan) -> int:
    """LoRA's frozen base, whole: stored as parameters are, with no
    gradient and no optimizer state (0 without LoRA)."""
    return sum(_nbytes(x) for x in jax.tree.leaves(state_plan.abstract.frozen))


def formula(state_plan: StatePlan) -> str:
    """The model-state formula in use, per parameter: at ZeRO-1 over 8 devices
    with a bf16 working copy, float32 gradients and Adam, "params 2 + grads 4
    + optimizer state 12/8 = 7.5 bytes per parameter"."""
    stage = zero_lib.stage(state_plan.zero_stage)
    sizes = state_plan.mesh_shape.sizes
    n = math.prod(sizes[a] for a in state_plan.mesh_shape.shard_axes)
    per = bytes_per_param(state_plan)
    terms, total = [], 0.0
    for key, name, sharded_ in (("params", "params", stage.params), ("grads", "grads", stage.grads),
                                ("opt_state", "optimizer state", stage.opt_state)):
        value = per[key] / (n if sharded_ else 1)
        total += value
        terms.append(f"{name} {per[key]:.3g}" + (f"/{n}" if sharded_ and n > 1 else ""))
    t, ep = sizes["tensor"], sizes.get("expert", 1)
    experts = ""
    if ep > 1 and (psi_e := expert_count(state_plan)):
        experts = (f"; the experts' {psi_e / stored_count(state_plan):.1%} of the parameters: "
                   f"/ expert {ep} where unsharded, / {_divisors(state_plan)[1]} where sharded")
    frozen = ""
    if base := _frozen_bytes(state_plan):  # per trainable parameter above; the base apart
        frozen = (f"; with LoRA's frozen base, {base:,} bytes"
                  + (f" / {n}" if stage.params and n > 1 else "") + (f" / tensor {t}" if t > 1 else ""))
    return (" + ".join(terms) + f" = {total:.4g} bytes per parameter"
            + (f", / tensor {t} = {total / t:.4g}" if t > 1 else "") + experts + frozen)


def sharded(state_plan: StatePlan) -> dict[str, int]:
    """Bytes per device of each state as its shardings store it."""
    a, s = state_plan.abstract, state_plan.specs
    frozen = 0 if a.frozen is None else bytes_per_device(a.frozen, state_plan.frozen_specs,
                                                          state_plan.mesh)
    return {
        "params": bytes_per_device(a.params, s.params, state_plan.mesh) + frozen,
        "grads": bytes_per_device(state_plan.abstract_grads, s.grads, state_plan.mesh),
        "opt_state": bytes_per_device(a.opt_state, s.opt_state, state_plan.mesh),
    }


def by_memory_kind(state_plan: StatePlan) -> dict[str, dict[str, int]]:
    """`sharded` split by where each state lives, read from the state's
    shardings' memory kinds: {"device": {...}, "host": {...}}. Gradients
    live on the device (offload.py moves them to the host only for the
    update)."""
    total = sharded(state_plan)
    kinds = state_plan.shardings
    out = {kind: {k: 0 for k in total} for kind in ("device", "host")}
    a = state_plan.abstract
    for name, abstract, tree in (("params", a.params, kinds.params),
                                 ("params", a.frozen, kinds.frozen),  # LoRA's base, if any
                                 ("opt_state", a.opt_state, kinds.opt_state)):
        for leaf, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(
                tree, is_leaf=lambda x: isinstance(x, NamedSharding))):
            where = "host" if s.memory_kind == offload_lib.HOST else "device"
            out[where][name] += nbytes(shard_elements(leaf.shape, s), leaf.dtype)
    out["device"]["grads"] = total["grads"]
    return out


def compiled(compiled_step) -> dict[str, int]:
    """The compiled step's bytes per device, from its `memory_analysis()`."""
    m = compiled_step.memory_analysis()
    return {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
    }


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per device of one run's train step, three ways and beside its
    activations and collectives; each {state: bytes} figure is keyed by STATES."""

    param_count: int  # the model's parameters
    bytes_per_param: dict[str, float]  # per state, before any ZeRO division
    formula: str  # the ZeRO formula in use, as a line of text
    theory_bytes: dict[str, float]  # the ZeRO paper's formula
    sharded_bytes: dict[str, int]  # the actual shardings
    device_bytes: dict[str, int]  # of sharded_bytes, in device memory
    host_bytes: dict[str, int]  # of sharded_bytes, in host memory (offload)
    compiled: dict[str, int] | None = None  # memory_analysis() of the compiled step
    activations: dict[str, float] | None = None  # analytic_bytes (and compiled_temp_bytes)
    collectives: CollectiveReport | None = None  # payload bytes per device per step
    trained_count: int | None = None  # under LoRA, the adapters' parameters (None: all)

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON object: figures not measured are left out,
        and the collectives' keys sit at the top level."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "collectives" and getattr(self, f.name) is not None}
        if self.collectives is not None:
            out.update(self.collectives.to_json())
        return out


def report(state_plan: StatePlan, compiled_step=None, activation_bytes: float | None = None,
           collectives: CollectiveReport | None = None) -> MemoryReport:
    """The report of `layout`, with the compiled step's figures where it is given."""
    split = by_memory_kind(state_plan)
    measured = None if compiled_step is None else compiled(compiled_step)
    activations = None
    if activation_bytes is not None:
        activations = {"analytic_bytes": activation_bytes}
        if measured is not None:
            activations["compiled_temp_bytes"] = measured["temp_bytes"]
    return MemoryReport(param_count(state_plan), bytes_per_param(state_plan), formula(state_plan),
                        theory(state_plan), sharded(state_plan), split["device"], split["host"],
                        measured, activations, collectives,
                        trained_count(state_plan) if state_plan.frozen_names else None)


# Set to 1 to start a run the fit check would refuse (swap, memory the check
# cannot see): the check's figures are a floor, never an estimate that may be high.
ENV_NO_FIT_CHECK = "ZERO_JAX_NO_FIT_CHECK"


class DoesNotFit(ValueError):
    """A run whose model states cannot fit its devices or its host."""


def _size(n: float) -> str:
    """Bytes as a size to read: 93.4 GB, 12.6 MB, 4.1 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:.0f} bytes"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@dataclasses.dataclass(frozen=True)
class Host:
    """This host as the fit check sees it: its devices' memory and its own."""

    platform: str  # the devices' platform
    devices: int  # devices of this run on this host, all its processes'
    processes: int  # processes of this run on this host
    limit: int | None  # a device's bytes_limit, where the backend says it
    room: tuple[int, str] | None  # the host's available bytes, and where that figure is from

    def need(self, split: dict[str, dict[str, int]]) -> int:
        """Bytes of model states on this host: every device's on the CPU
        backend (its devices share the host's memory), else what is offloaded."""
        on_device, offloaded = sum(split["device"].values()), sum(split["host"].values())
        return (on_device + offloaded if self.platform == "cpu" else offloaded) * self.devices

    def device_short(self, split: dict[str, dict[str, int]]) -> bool:
        return self.limit is not None and sum(split["device"].values()) > self.limit

    def host_short(self, split: dict[str, dict[str, int]]) -> bool:
        return self.room is not None and self.need(split) > self.room[0]


def check_fits(state_plan: StatePlan, what: str, processes_here: int = 1,
               room: tuple[int, str] | None | str = "measure") -> None:
    """Raise DoesNotFit, naming the bytes and what to change, when the
    model states of `layout` (`what`: the flag that chose the model, for the
    message) need more than a device's memory (where the backend says it:
    `memory_stats()["bytes_limit"]`) or than this host has available
    (`room`: (bytes, where from); by default procmem.available()).

    Read from the abstract layout only: nothing is compiled or allocated.
    The devices of this process share the host's memory on the CPU backend;
    elsewhere the host holds what is offloaded. `processes_here`: processes
    of this run on this host (several under zero-jax launch), each with
    as many devices as this one."""
    if isinstance(state_plan.mesh, jax.sharding.AbstractMesh) or os.environ.get(ENV_NO_FIT_CHECK) == "1":
        return
    split = by_memory_kind(state_plan)
    local = state_plan.mesh.local_devices
    platform = local[0].platform
    host = Host(platform, len(local) * processes_here, processes_here,
                None if platform == "cpu" else (local[0].memory_stats() or {}).get("bytes_limit"),
                procmem.available() if room == "measure" else room)
    if host.device_short(split) or host.host_short(split):
        raise DoesNotFit(_does_not_fit(state_plan, what, split, host))


def _does_not_fit(state_plan: StatePlan, what: str, split: dict[str, dict[str, int]],
                  host: Host) -> str:
    """The one line of a refused run: what it needs per device and on this
    host, what there is, and what to change."""
    names = {"params": "params", "grads": "grads", "opt_state": "optimizer state"}
    on_device, offloaded = sum(split["device"].values()), sum(split["host"].values())
    host_need, device_short, room = host.need(split), host.device_short(split), host.room
    parts = " + ".join(f"{names[k]} {_size(split['device'][k])}" for k in STATES
                       if split["device"][k])
    axes = ",".join(f"{a}={n}" for a, n in state_plan.mesh_shape.sizes.items() if n > 1) or "1 device"
    need = f"{_size(on_device)} per device ({parts}; ZeRO-{state_plan.zero_stage} over {axes})"
    if offloaded:
        need += f", plus {_size(offloaded)} per device offloaded to host memory"
    if device_short:
        need += f", over the {_size(host.limit)} of a {host.platform} device (its bytes_limit)"
    sharers = (f"{host.devices} CPU devices" + (f" of {host.processes} processes"
                                                if host.processes > 1 else "") + " share its memory"
               if host.platform == "cpu" else f"{host.devices} devices offload to it")
    need += (f", and {_size(host_need)} on this host ({sharers}), which has "
             + (f"{_size(room[0])} available ({room[1]})" if room else "an unknown amount free"))
    fixes = []
    if device_short:
        if not state_plan.host_opt and zero_lib.stage(state_plan.zero_stage).opt_state and split["device"]["opt_state"]:
            fixes.append(f"--offload-optimizer (moves {_size(split['device']['opt_state'])} per "
                         "device to host memory)")
        if not state_plan.host_params and split["device"]["params"]:
            fixes.append("--offload-params (with --zero-stage 3)")
    if not zero_lib.stage(state_plan.zero_stage).params:
        fixes.append("--zero-stage 3 (shards every state)")
    if device_short:
        fixes.append("more devices to shard over")
    elif room and zero_lib.stage(state_plan.zero_stage).params:
        fixes.append(f"about {math.ceil(host_need / max(room[0], 1))} hosts like this one to "
                     "shard over")
    else:
        fixes.append("more hosts to shard over")
    fixes.append("a smaller model")
    where = "a device" if device_short else "this host"
    return (f"{what} ({_count(param_count(state_plan))} parameters) does not fit {where}: its model "
            f"states alone need {need}; nothing was allocated. Use {', '.join(fixes[:-1])} or "
            f"{fixes[-1]}")
