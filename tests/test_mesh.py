"""Mesh configs: files, inline specs, -1 fill, and errors that say what to change."""

from pathlib import Path

import jax
import numpy as np
import pytest

from zero_jax.sharding import mesh as mesh_lib
from zero_jax.sharding.mesh import MeshConfig, MeshError

MESHES = Path(__file__).resolve().parent.parent / "meshes"


def test_inline_spec_fills_missing_axes_with_one():
    cfg = mesh_lib.parse_inline("data=2,fsdp=4")
    mesh, shape = mesh_lib.build_mesh(cfg)
    assert dict(mesh.shape) == {"pipe": 1, "data": 2, "fsdp": 4, "expert": 1, "context": 1,
                                "tensor": 1}
    assert shape.shard_axes == ("data", "fsdp")
    assert mesh.devices.size == 8


def test_minus_one_fills_from_the_device_count():
    _, shape = mesh_lib.build_mesh(mesh_lib.parse_inline("data=2,fsdp=-1"))
    assert shape.sizes["fsdp"] == 4


@pytest.mark.parametrize("name,devices,sizes", [
    ("cpu-8", 8, {"fsdp": 8}),
    ("cpu-1", 1, {}),
    ("gpu-1x8", 8, {"fsdp": 8}),
    ("gpu-4x8", 32, {"data": 4, "fsdp": 8}),
    ("tpu-v5p-64", 32, {"fsdp": 32}),
])
def test_every_mesh_file_resolves_for_its_cluster(name, devices, sizes):
    cfg = mesh_lib.load(name)
    shape = cfg.resolve(devices)
    assert {a: s for a, s in shape.sizes.items() if s > 1} == sizes
    assert shape.num_devices == devices


def crosses_hosts(shape: mesh_lib.MeshShape, axis: str) -> bool:
    """Whether `axis` spans hosts: its size over the network between them is above 1."""
    return shape.dcn[mesh_lib.AXES.index(axis)] > 1


def test_gpu_4x8_is_hybrid_sharding_across_nodes():
    shape = mesh_lib.load(str(MESHES / "gpu-4x8.toml")).resolve(32)
    assert crosses_hosts(shape, "data") and not crosses_hosts(shape, "fsdp")
    assert shape.shard_axes == ("fsdp",)  # replicate across nodes, shard inside


def test_dcn_axes_are_outer_blocks_of_devices():
    # data crosses 2 "hosts" of 4 devices; fsdp stays inside each host.
    cfg = MeshConfig(ici=(1, 1, 4, 1, 1, 1), dcn=(1, 2, 1, 1, 1, 1))
    mesh, _ = mesh_lib.build_mesh(cfg)
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 4)
    assert ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # An axis with both parts: position i is host i // ici, slot i % ici.
    cfg = MeshConfig(ici=(1, 2, 1, 1, 1, 1), dcn=(1, 1, 4, 1, 1, 1))  # data: 2 inside, fsdp: 4 hosts
    mesh, _ = mesh_lib.build_mesh(cfg)
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 4)
    assert ids.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("spec,message", [
    ("fsdp=4", "needs 4 devices but 8 are present"),
    ("data=3,fsdp=-1", "does not divide the 8 devices"),
    ("dat=8", "unknown axis 'dat'"),
    ("data=2,data=4", "given twice"),
    ("fsdp=0", "is not a size"),
    ("fsdp=-2", "is not a size"),
    ("data=-1,fsdp=-1", "only one size may be filled"),
    ("fsdp=two", "not an integer"),
    ("fsdp", "is not axis=size"),
])
def test_bad_meshes_are_clear_errors(spec, message):
    with pytest.raises(MeshError, match=message):
        mesh_lib.build_mesh(mesh_lib.parse_inline(spec))


def test_bad_mesh_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[ici]\nfsdp = 8\nexperts = 2\n")
    with pytest.raises(MeshError, match="unknown axis 'experts'"):
        mesh_lib.load(str(bad))
    bad.write_text('zero_shard_axes = ["tensor"]\n[ici]\nfsdp = 8\n')
    with pytest.raises(MeshError, match="data-parallel axes only"):
        mesh_lib.load(str(bad))
    with pytest.raises(MeshError, match="no such file"):
        mesh_lib.load("no-such-cluster")


def test_one_process_may_simulate_several_hosts():
    # One process holding 8 devices may simulate 2 hosts (planning, tests).
    cfg = MeshConfig(ici=(1, 1, 4, 1, 1, 1), dcn=(1, 2, 1, 1, 1, 1))
    mesh, shape = mesh_lib.build_mesh(cfg, jax.devices())
    assert crosses_hosts(shape, "data")
