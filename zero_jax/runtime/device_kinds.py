"""Accelerator kinds as data: one TOML per kind in meshes/devices/, each
number with its source beside it (memory, peak FLOP/s, link bandwidths and
latencies, what GEMMs, fused attention and streaming kernels sustain, and
the host's memory and links for offload)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from zero_jax.config.load import MESHES

DIRECTORY = MESHES / "devices"


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator and the links around it, per device."""

    name: str
    hbm_bytes: int  # memory per device
    peak_flops: float  # dense bf16 FLOP/s
    devices_per_node: int  # devices sharing the fast links (a DGX node, a TPU host)
    intra_node_bw: float  # bytes/s per device, one direction, inside a node (NVLink)
    inter_node_bw: float  # bytes/s per device, one direction, across nodes (InfiniBand, DCN)
    # The planner's kernel and link model (planner/kernels.py, planner/links.py).
    hbm_bw: float  # HBM bytes/s (datasheet)
    hbm_efficiency: float  # fraction of hbm_bw a streaming kernel reaches
    compute_units: int  # SMs (tiles run at once, one each)
    gemm_efficiency: float  # fraction of peak a large, well-shaped GEMM sustains (measured)
    gemm_tiles: tuple[tuple[int, int, float], ...]  # (rows, cols, relative efficiency) per tile shape
    flash_efficiency: float  # fraction of peak fused attention sustains, forward and backward
    launch_s: float  # seconds between one kernel and the next
    step_efficiency: float  # of the kernels' summed time, what a real step reaches (fitted)
    collective_latency: float  # seconds a collective costs whatever its size
    intra_node_latency: float  # seconds per ring step inside a node
    inter_node_latency: float  # seconds per ring step across nodes
    mfu_ceiling: float  # the best MFU published on this kind: no plan predicts above it
    # Measured GEMMs (scripts/gpu_checks.sh): (m, n, k, bytes per element, FLOP/s) each;
    # where there are, they replace gemm_efficiency and the tiles, and lift mfu_ceiling.
    gemm_sweep: tuple[tuple[float, ...], ...] = ()
    ici_domain: int = 0  # devices the fast links join, if more than a node (a TPU slice)
    peak_flops_fp32: float = 0.0  # float32 matmul FLOP/s at JAX's default precision (TF32 on GPUs)
    device_kinds: tuple[str, ...] = ()  # jax.Device.device_kind strings of this kind (MFU)
    # Host offload (offload.py); 0 where not known: no offload layouts are planned.
    host_bytes_per_node: int = 0  # host memory of one node
    host_link_bw: float = 0.0  # bytes/s per device, one direction, host <-> device (PCIe, C2C)
    host_mem_bw: float = 0.0  # host memory bytes/s of one node (bounds the update run there)

    @property
    def can_offload(self) -> bool:
        return self.host_bytes_per_node > 0 and self.host_link_bw > 0 and self.host_mem_bw > 0

    @property
    def fast_domain(self) -> int:
        """Devices joined by the intra-node links."""
        return max(self.ici_domain, self.devices_per_node)


def kinds() -> list[str]:
    return sorted(p.stem for p in DIRECTORY.glob("*.toml"))


def load(kind: str) -> Device:
    """A device kind by file stem (`a100-80gb`) or path."""
    path = Path(kind) if kind.endswith(".toml") else DIRECTORY / f"{kind}.toml"
    if not path.exists():
        raise ValueError(f"no device kind {kind!r}: choose from {', '.join(kinds())}, "
                         f"or give a TOML path")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None
    fields = {f.name for f in dataclasses.fields(Device)}
    unknown = set(raw) - fields
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(fields)}")
    missing = {f.name for f in dataclasses.fields(Device)
               if f.default is dataclasses.MISSING} - set(raw)
    if missing:
        raise ValueError(f"{path}: missing keys {sorted(missing)} (see meshes/devices/a100-80gb.toml "
                         f"for each with its source)")
    if "device_kinds" in raw:
        raw["device_kinds"] = tuple(raw["device_kinds"])
    raw["gemm_tiles"] = tuple(tuple(t) for t in raw["gemm_tiles"])
    raw["gemm_sweep"] = tuple(tuple(t) for t in raw.get("gemm_sweep", ()))
    return Device(**raw)


def for_device_kind(device_kind: str) -> Device | None:
    """The kind whose `device_kinds` names this `jax.Device.device_kind`
    (exactly, else as a prefix), or None."""
    known = [load(k) for k in kinds()]
    exact = [d for d in known if device_kind in d.device_kinds]
    prefix = [d for d in known if any(device_kind.startswith(k) for k in d.device_kinds)]
    return (exact or prefix or [None])[0]
