"""Mesh configs (TOML files in meshes/ or inline specs) -> jax.sharding.Mesh.

A mesh config gives each named axis a size inside one host or slice (`ici`, the
fast interconnect) and a size across hosts or slices (`dcn`); an axis's size in
the mesh is the product of the two. One size in the whole config may be -1, and
is filled from the device count. Validation happens here, before anything is
compiled, because `jax.make_mesh` silently uses a subset of the devices when
the shape does not cover them all.

File format:

    description = "one node of 8 GPUs"
    zero_shard_axes = ["fsdp"]   # optional: ZeRO shards over these axes only

    [ici]                        # inside a host / slice
    fsdp = -1
    [dcn]                        # across hosts / slices
    data = 4
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from zero_jax.config.load import MESHES
from zero_jax.runtime import cpu

# Outermost to innermost: the innermost axis gets the closest devices, so the
# axis with the most traffic (tensor) is last and the lightest (pipe) first;
# `expert` (a mixture of experts' all-to-alls) and `context` (the sequence's
# ring or all-to-alls, every layer) sit just outside `tensor`.
AXES: tuple[str, ...] = ("pipe", "data", "fsdp", "expert", "context", "tensor")
# The global batch is split over these axes. `expert` is data-parallel for
# every parameter but the experts', which it splits.
DATA_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
# ZeRO shards state over these unless a config narrows `zero_shard_axes`
# (hybrid sharding): the data axes, and `context`, whose devices see other
# tokens of the same rows, so hold the same parameters and sum their
# gradients as data-parallel devices do.
ZERO_AXES: tuple[str, ...] = DATA_AXES + ("context",)




class MeshError(ValueError):
    """A mesh config that cannot be built on the devices present."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A mesh as written by the user, before it meets the devices."""

    ici: tuple[int, ...]  # per AXES entry: size inside a host/slice (-1: fill)
    dcn: tuple[int, ...]  # per AXES entry: size across hosts/slices (-1: fill)
    zero_shard_axes: tuple[str, ...] | None = None  # None: every data axis
    name: str = "inline"  # file stem or "inline", for messages
    description: str = ""  # one line shown in the plan

    def __post_init__(self):
        for where, sizes in (("ici", self.ici), ("dcn", self.dcn)):
            if len(sizes) != len(AXES):
                raise MeshError(f"mesh {self.name}: [{where}] needs one size per axis {AXES}")
            for axis, size in zip(AXES, sizes):
                if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                    raise MeshError(
                        f"mesh {self.name}: [{where}] {axis} = {size!r} is not a size; "
                        "use a positive integer, or -1 once to fill from the device count")
        fills = [s for s in self.ici + self.dcn if s == -1]
        if len(fills) > 1:
            raise MeshError(f"mesh {self.name}: -1 appears {len(fills)} times; "
                            "only one size may be filled from the device count")
        if self.zero_shard_axes is not None:
            for axis in self.zero_shard_axes:
                if axis not in ZERO_AXES:
                    raise MeshError(
                        f"mesh {self.name}: zero_shard_axes names {axis!r}; ZeRO shards "
                        f"over data-parallel axes only: choose from {ZERO_AXES}")
            if len(set(self.zero_shard_axes)) != len(self.zero_shard_axes):
                raise MeshError(f"mesh {self.name}: zero_shard_axes repeats an axis: "
                                f"{self.zero_shard_axes}")

    @property
    def fixed_devices(self) -> int:
        """Product of all sizes that are not -1."""
        return math.prod(s for s in self.ici + self.dcn if s != -1)

    def resolve(self, num_devices: int) -> "MeshShape":
        """Fill the -1 and check that the mesh covers exactly `num_devices`."""
        fixed = self.fixed_devices
        ici, dcn = list(self.ici), list(self.dcn)
        if -1 in ici + dcn:
            if num_devices % fixed:
                raise MeshError(
                    f"mesh {self.name}: the fixed sizes multiply to {fixed}, which does not "
                    f"divide the {num_devices} devices present, so -1 cannot be filled; "
                    f"change the sizes so their product divides {num_devices}")
            fill = num_devices // fixed
            if -1 in ici:
                ici[ici.index(-1)] = fill
            else:
                dcn[dcn.index(-1)] = fill
        elif fixed != num_devices:
            raise MeshError(
                f"mesh {self.name}: {self._describe(ici, dcn)} needs {fixed} devices but "
                f"{num_devices} are present; change the sizes so they multiply to "
                f"{num_devices}, or put -1 on one axis to fill it; {cpu.fix_hint(fixed)}")
        return MeshShape(tuple(ici), tuple(dcn), self.zero_shard_axes, self.name)

    @staticmethod
    def _describe(ici, dcn) -> str:
        parts = [f"{a}={i * d}" for a, i, d in zip(AXES, ici, dcn) if i * d != 1]
        return ",".join(parts) or "a 1-device mesh"


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A resolved mesh shape: every size known and the product checked."""

    ici: tuple[int, ...]
    dcn: tuple[int, ...]
    zero_shard_axes: tuple[str, ...] | None
    name: str

    @property
    def sizes(self) -> dict[str, int]:
        return {a: i * d for a, i, d in zip(AXES, self.ici, self.dcn)}

    def split(self, axis: str) -> tuple[int, int]:
        """`axis`'s size inside a host or slice, and across them."""
        i = AXES.index(axis)
        return self.ici[i], self.dcn[i]

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def data_parallel_size(self) -> int:
        """The devices the batch is split over (DATA_AXES)."""
        return math.prod(self.sizes[a] for a in DATA_AXES)

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The axes ZeRO shards state over (size-1 axes dropped)."""
        axes = ZERO_AXES if self.zero_shard_axes is None else self.zero_shard_axes
        return tuple(a for a in axes if self.sizes[a] > 1)


def parse_inline(spec: str) -> MeshConfig:
    """`data=2,fsdp=4` -> MeshConfig (all axes inside one host; omitted axes 1)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep:
            raise MeshError(f"--mesh {spec!r}: {part!r} is not axis=size (e.g. data=2,fsdp=4)")
        if name not in AXES:
            raise MeshError(f"--mesh {spec!r}: unknown axis {name!r}; known axes: {', '.join(AXES)}")
        if name in sizes:
            raise MeshError(f"--mesh {spec!r}: axis {name!r} is given twice; give each axis once")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise MeshError(f"--mesh {spec!r}: size of {name!r} is {value.strip()!r}, "
                            "not an integer") from None
    if not sizes:
        raise MeshError(f"--mesh {spec!r} names no axis; write e.g. --mesh data=2,fsdp=4")
    return MeshConfig(ici=tuple(sizes.get(a, 1) for a in AXES), dcn=(1,) * len(AXES))


def load_file(path: str | Path) -> MeshConfig:
    """Read a mesh TOML file (format in the module docstring)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise MeshError(f"mesh file {path}: not valid TOML ({e})") from None
    except OSError as e:  # a directory, no permission
        raise MeshError(f"mesh file {path}: cannot be read ({e.strerror})") from None
    known_keys = {"description", "zero_shard_axes", "ici", "dcn"}
    extra = set(raw) - known_keys
    if extra:
        raise MeshError(f"{path}: unknown key(s) {sorted(extra)}; allowed: {sorted(known_keys)}")

    def table(where: str) -> tuple[int, ...]:
        entries = raw.get(where, {})
        if not isinstance(entries, dict):
            raise MeshError(f"{path}: [{where}] must be a table of axis = size")
        for name in entries:
            if name not in AXES:
                raise MeshError(f"{path}: [{where}] names unknown axis {name!r}; "
                                f"known axes: {', '.join(AXES)}")
        return tuple(entries.get(a, 1) for a in AXES)

    shard_axes = raw.get("zero_shard_axes")
    if isinstance(shard_axes, str):  # "fsdp" for ["fsdp"], not four one-letter axes
        shard_axes = [shard_axes]
    return MeshConfig(
        ici=table("ici"), dcn=table("dcn"),
        zero_shard_axes=None if shard_axes is None else tuple(shard_axes),
        name=path.stem, description=raw.get("description", ""))


def load(spec: str) -> MeshConfig:
    """A mesh from a file path, a name in meshes/ (e.g. `cpu-8`), or an inline spec."""
    if "=" in spec:
        return parse_inline(spec)
    path = Path(spec)
    if not path.exists():
        directory = MESHES
        candidate = directory / f"{spec}.toml"
        if candidate.exists():
            path = candidate
        elif "/" in spec or spec.endswith(".toml"):
            raise MeshError(f"--mesh {spec}: no such mesh file")
        else:
            known = ", ".join(sorted(p.stem for p in directory.glob("*.toml")))
            raise MeshError(f"--mesh {spec}: no such file, and no meshes/{spec}.toml (there: "
                            f"{known}); or write the mesh inline, like data=2,fsdp=4")
    return load_file(path)


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, MeshShape]:
    """Resolve `config` against `devices` (default: all) and build the Mesh.

    All axes are automatic (GSPMD) axes, so jit inserts the collectives. Axes
    with dcn > 1 span hosts: with several processes the devices are ordered by
    `create_hybrid_device_mesh` so that ici axes stay inside one process.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    sizes = tuple(shape.sizes.values())
    processes = sorted({d.process_index for d in devices})
    num_granules = math.prod(shape.dcn)
    if num_granules > 1 and len(processes) > 1:
        if num_granules != len(processes):
            raise MeshError(
                f"mesh {config.name}: the [dcn] sizes multiply to {num_granules} but the run "
                f"has {len(processes)} processes; [dcn] describes the axes across hosts, so "
                "its product must equal the number of processes")
        grid = mesh_utils.create_hybrid_device_mesh(
            shape.ici, shape.dcn, devices, process_is_granule=True)
    elif num_granules > 1:
        # One process holding every device (simulation, planning): lay the
        # devices out as consecutive blocks per host, as the hybrid mesh would.
        grid = _blocked_grid(devices, shape)
    else:
        grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES)), shape


def _blocked_grid(devices: Sequence[jax.Device], shape: MeshShape) -> np.ndarray:
    """Devices as (*dcn, *ici) blocks, interleaved per axis to (dcn_a * ici_a).

    Position i of an axis is (host block i // ici_a, slot i % ici_a): the same
    order `create_hybrid_device_mesh` gives with one granule per host.
    """
    n = len(AXES)
    blocks = np.asarray(devices).reshape(shape.dcn + shape.ici)
    order = [k for a in range(n) for k in (a, n + a)]
    return blocks.transpose(order).reshape(tuple(shape.sizes.values()))
