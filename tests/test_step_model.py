"""The planner's step-time model: GEMMs from their shapes by hand, collectives
as latency plus bytes, the MFU ceiling, and the published runs it is fitted
to, table and all."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_jax.model.contract import Op
from zero_jax.planner import choices, kernels, links, published, search
from zero_jax.runtime import device_kinds

ROOT = Path(__file__).resolve().parent.parent
A100 = device_kinds.load("a100-80gb")
FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))


def test_a_gemm_is_its_roofline_on_the_fastest_tile_in_whole_waves():
    """4096^3 in bf16 on an A100, by hand: 512 tiles of 128 x 256 are 5 waves
    of 108 SMs, 1024 of 128 x 128 are 10; each SM runs at a 108th of peak x
    the measured large-GEMM efficiency (x the tile's own)."""
    g = kernels.Gemm(4096, 4096, 4096)
    unit = 312e12 * 0.859 / 108
    wide = 5 * 2 * 128 * 256 * 4096 / unit
    square = 10 * 2 * 128 * 128 * 4096 / (unit * 0.9)
    assert kernels.gemm_s(g, 2, A100) == pytest.approx(min(wide, square) + 3e-6)
    # A thin product is bound by its bytes: (m k + k n + m n) elements at HBM speed.
    thin = kernels.Gemm(8, 8192, 8192)
    nbytes = (8 * 8192 + 8192 * 8192 + 8 * 8192) * 2
    assert kernels.gemm_s(thin, 2, A100) == pytest.approx(nbytes / (2.039e12 * 0.85) + 3e-6)


def test_one_tile_past_a_wave_costs_a_whole_wave():
    one_tile = dataclasses.replace(A100, gemm_tiles=((128, 256, 1.0),))
    full = kernels.gemm_s(kernels.Gemm(128 * 108, 256, 4096), 2, one_tile)
    over = kernels.gemm_s(kernels.Gemm(128 * 109, 256, 4096), 2, one_tile)
    assert (over - 3e-6) == pytest.approx(2 * (full - 3e-6))


def test_tensor_parallel_products_take_their_split_shapes():
    """A column-parallel product divides its outputs, a row-parallel one its
    inputs; attention runs per sequence and head, the heads divided."""
    shape = kernels._Shape(rows=4096, seqs=2, seq=2048, keys=2048, tensor=4,
                           sequence_parallel=False, itemsize=2, heads=32, widths={}, splits={})
    D = 4096
    qkv = Op("qkv", "qkv", 2 * D * 3 * D, ("norm_1",), dot=True, width=3 * D, split="out")
    out = Op("out", None, 2 * D * D, ("ctx",), dot=True, width=D, split="in")
    scores = Op("scores", None, 2 * 2048 * D, ("qkv",), dot=True, width=32 * 2048, split="out")
    ctx = Op("ctx", "attn_ctx", 2 * 2048 * D, ("probs", "qkv"), dot=True, width=D, split="out")
    assert kernels._gemm(qkv, shape) == kernels.Gemm(4096, 3 * D / 4, D)
    assert kernels._gemm(out, shape) == kernels.Gemm(4096, D, D / 4)
    assert kernels._gemm(scores, shape) == kernels.Gemm(2048, 2048, 128, 2 * 8)
    assert kernels._gemm(ctx, shape) == kernels.Gemm(2048, 128, 2048, 2 * 8)


def test_a_collective_is_its_latency_plus_its_bytes_on_a_ring_or_a_tree():
    link = links.Link(bandwidth=25e9, latency=9.6e-6, base=8.4e-6)
    big, small, n = 1e9, 1e3, 64
    ring = 8.4e-6 + 2 * 63 * 9.6e-6 + 2 * 63 / 64 * big / 25e9
    assert links.collective_s("all-reduce", big, n, link) == pytest.approx(ring)
    tree = 8.4e-6 + 2 * 6 * 9.6e-6 + 2 * small / 25e9  # log2 64 = 6 levels, up and down
    assert links.collective_s("all-reduce", small, n, link) == pytest.approx(tree)
    assert links.collective_s("all-gather", big, n, link) == pytest.approx(
        8.4e-6 + 63 * 9.6e-6 + 63 / 64 * big / 25e9)
    assert links.collective_s("all-reduce", big, 1, link) == 0.0


def test_no_layout_is_predicted_above_the_kinds_published_ceiling():
    """The 1.7B row's layout on a device whose ceiling is set low: the step
    stretches to it and says so."""
    run = published.RUNS[0]
    low = dataclasses.replace(A100, mfu_ceiling=0.2)
    cluster = choices.Cluster(low, run.nodes, 8)
    problem, layouts = published.problem(run, cluster)
    best = search.fitting(search.estimate_all(problem, layouts[:4]))[0]
    assert best.time.at_ceiling
    assert best.time.mfu(32, low.peak_flops) == pytest.approx(0.2)


def test_the_1_7b_rows_layouts_stay_under_55_percent_mfu():
    """Narayanan et al.'s 1.7B row on 32 A100s with its own kernels (attention
    written out): no layout of the search above 55% MFU. In CI the layouts
    without a pipeline (the fastest); all of them under ZERO_JAX_FULL_GRID=1."""
    run = published.RUNS[0]
    cluster = choices.Cluster(A100, run.nodes, 8)
    problem, layouts = published.problem(run, cluster, choices.Space())
    if not FULL:
        layouts = [c for c in layouts if c.pipe == 1 and not c.offload]
    fitting = search.fitting(search.estimate_all(problem, layouts))
    assert len(fitting) > 100
    assert max(e.time.mfu(32, A100.peak_flops) for e in fitting) <= 0.55


def test_the_published_runs_table_is_what_the_script_computes():
    """docs/planning.md's table is scripts/published_runs.py's, and every run
    is predicted within 15% of its published figure."""
    predictions = [published.predict(run) for run in published.RUNS]
    for p in predictions:
        assert abs(p.ratio - 1) <= published.LIMIT, (p.run.name, p.predicted, p.run.published)
    docs = (ROOT / "docs" / "planning.md").read_text()
    assert published.table_in(docs) == published.table(predictions)


def test_a_measured_gemm_sweep_replaces_the_estimated_curve(tmp_path):
    """scripts/gemm_sweep.py's line, put in a device kind's TOML: each product
    at the rate of the nearest swept shape, and no MFU ceiling."""
    toml = tmp_path / "sweep.toml"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gemm_sweep.py"), "--shapes",
                    "256x256x256,512x128x256", "--dtypes", "float32", "--repeats", "2",
                    "--toml", str(toml)], check=True, capture_output=True, cwd=ROOT)
    line = toml.read_text()
    kind = tmp_path / "measured.toml"
    kind.write_text((ROOT / "meshes" / "devices" / "a100-80gb.toml").read_text() + line)
    measured = device_kinds.load(str(kind))
    (m, n, k, itemsize, rate), _ = measured.gemm_sweep
    assert (m, n, k, itemsize) == (256, 256, 256, 4) and rate > 0
    near = kernels.Gemm(300, 250, 240)  # nearer the first swept shape than the second
    assert kernels.gemm_s(near, 4, measured) == pytest.approx(near.flops / rate + measured.launch_s)
    run = published.RUNS[0]
    problem, layouts = published.problem(run, choices.Cluster(measured, run.nodes, 8))
    est = search.estimate_all(problem, layouts[:1])[0]
    assert est.time.floor_s == 0.0 and not est.time.at_ceiling
