"""Dropless experts' grouped GEMMs (zero_jax/model/grouped.py) and their
all-to-all (zero_jax/model/exchange.py).

The tiled grouped GEMM against jax.lax.ragged_dot, values and gradients;
the padded exchange against ragged_all_to_all's definition; and, on the
same routing over expert=4, the dispatch through today's worst-case blocks
(ragged_dot, which XLA:CPU computes densely over a buffer sized for the
worst case) against the tiled path: equal outputs, and the FLOPs of every
dot each compiled program runs against the routed copies' FLOPs.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from models.llama import moe
from tests.helpers import make_job
from zero_jax.analysis.dot_flops import dot_flops
from zero_jax.config.sections import ConfigError
from zero_jax.model import exchange, grouped

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tile", [1, 4, 16])
def test_tiled_matches_ragged_dot_with_its_gradients(tile):
    """Empty groups, partial tiles and rows past the counts' sum (zero)."""
    rng = np.random.default_rng(0)
    counts = jnp.array([13, 0, 9, 1, 17], jnp.int32)  # 40 of 48 rows
    x = jnp.asarray(rng.normal(size=(48, 12)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 12, 10)), jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w)))

    tiled = lambda x, w: grouped.tiled(x, w, counts, tile)
    ragged = lambda x, w: jax.lax.ragged_dot(x, w, counts)
    np.testing.assert_allclose(tiled(x, w), ragged(x, w), rtol=1e-5, atol=1e-5)
    assert not np.any(tiled(x, w)[40:])
    for got, want in zip(jax.grad(loss(tiled), (0, 1))(x, w), jax.grad(loss(ragged), (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert int(grouped.executed_rows(counts, tile)) <= 40 + 5 * (tile - 1)


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("expert",))


def test_padded_exchange_is_ragged_all_to_all():
    """Uneven counts, some zero: each device's buffer holds every source's
    rows, source 0's first, as ragged_all_to_all defines it; the ragged
    transport lowers (forward and backward) to ragged_all_to_all."""
    ep, A, D = 4, 6, 3
    rng = np.random.default_rng(1)
    sent = rng.integers(0, 3, size=(ep, ep)).astype(np.int32)  # sent[s, d] <= A / ep
    rows = rng.normal(size=(ep, A, D)).astype(np.float32)

    def run(transport):
        def body(rows_AxD, sent_P):
            there, _ = exchange.routes(sent_P[0], "expert")
            return exchange.send(rows_AxD[0], jnp.zeros((ep * A, D)), there, "expert",
                                 transport)[None]
        return jax.jit(jax.shard_map(body, mesh=_mesh(ep), in_specs=(P("expert"), P("expert")),
                                     out_specs=P("expert")))

    got = np.asarray(run("padded")(rows, sent))
    for d in range(ep):
        want = np.concatenate([rows[s, sent[s, :d].sum():sent[s, :d + 1].sum()]
                               for s in range(ep)])
        np.testing.assert_array_equal(got[d, :len(want)], want)
        assert not got[d, len(want):].any()
    lowered = jax.jit(jax.grad(lambda r: run("ragged")(r, sent).sum())).lower(rows)
    assert "ragged_all_to_all" in lowered.as_text()


def _dispatch(kernels, x, routing, w, E, ep):
    """moe.dropless over an expert axis of `ep` devices, tokens split over it."""
    def body(x, weights, experts, *w):
        r = moe.Routing(weights, experts, None, None)
        return moe.dropless(x, r, *w, E, "expert", ep, kernels)

    spec = P("expert")
    return jax.jit(jax.shard_map(body, mesh=_mesh(ep), in_specs=(spec,) * 6, out_specs=spec)
                   ).lower(x, routing.weights_Nxk, routing.experts_Nxk, *w).compile()


def test_ragged_path_against_worst_case_blocks_on_the_same_routing():
    """deepseek-tiny's experts (E=8, k=2, D=128, F=64) on expert=4, 256
    tokens a device, a skewed router: the tiled path's outputs equal
    today's (ragged_dot over the worst-case buffer), and the dots it runs
    are within 10% of the routed copies' FLOPs, where today's are E times."""
    ep, E, k, D, F, N = 4, 8, 2, 128, 64, 256
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(ep * N, D)), jnp.float32)
    skew = np.linspace(0, 1.5, E)  # later experts chosen more often: unequal counts
    routing = moe.route(jnp.asarray(rng.normal(size=(ep * N, E)) + skew, jnp.float32), k, True)
    w = [jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32)
         for s in ((E, D, F), (E, D, F), (E, F, D))]
    today = _dispatch(moe.Kernels("ragged_dot", "padded"), x, routing, w, E, ep)
    tiled = _dispatch(moe.Kernels("tiled", "padded"), x, routing, w, E, ep)
    args = (x, routing.weights_Nxk, routing.experts_Nxk, *w)
    np.testing.assert_allclose(tiled(*args), today(*args), rtol=1e-5, atol=1e-5)

    routed = 3 * 2 * ep * N * k * D * F  # gate, up, down over every copy, all devices
    counts = np.bincount(np.asarray(routing.experts_Nxk).ravel(), minlength=E)
    tile = grouped.tile_rows(N * k, E // ep)
    trips = [int(grouped.plan(jnp.asarray(c), tile, ep * N * k).count)
             for c in counts.reshape(ep, E // ep)]  # each device's tiles
    ran_today = ep * dot_flops(today.as_text())
    ran_tiled = sum(dot_flops(tiled.as_text(), n) for n in trips)
    print(f"\nrouted {routed:,}  tiled {ran_tiled:,} ({ran_tiled / routed:.3f}x)  "
          f"worst-case blocks {ran_today:,} ({ran_today / routed:.2f}x)  tile {tile}")
    assert abs(ran_tiled / routed - 1) < 0.10
    assert ran_today / routed > E * 0.95


def test_ragged_exchange_is_refused_where_the_backend_lacks_it(corpus):
    with pytest.raises(ConfigError, match="--expert-exchange ragged on cpu"):
        make_job(corpus, model="deepseek-tiny", mesh="expert=4,data=2", expert_exchange="ragged")


def test_the_grouped_gemm_check_runs_its_stand_in():
    """scripts/grouped_gemm.py at the size gpu_checks.sh runs without a GPU:
    both GEMMs agree, and the tiled one runs near the routed FLOPs."""
    out = subprocess.run([sys.executable, "scripts/grouped_gemm.py", "--rows", "512", "--groups",
                          "4", "--d-model", "64", "--d-expert", "32", "--dtype", "float32",
                          "--repeats", "1"], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    assert float(rows["tiled"][3]) < 1.1 and float(rows["ragged_dot"][3]) == pytest.approx(4.0)
    assert float(out.rsplit(" ", 1)[1]) < 1e-5


def test_the_plan_counts_the_dispatch_buffers_sized_for_the_worst_case():
    """Over expert=e a mixture layer holds buffers of e A copies (A = k s b
    a device's own): none on one device, and under full remat one layer's
    (4 e + 1) A h + 3 (e - 1) A f, rebuilt; without remat every layer's."""
    from models.llama import config as llama_config
    from zero_jax.model.remat import Remat
    cfg = llama_config.config("deepseek-v3", 0)
    assert cfg.dispatch_parts(1, 4096, 2, Remat("full"), 1) == (0.0, 0.0, 0.0)
    A, h, f = 8 * 4096, 7168, 2048
    full = cfg.dispatch_parts(1, 4096, 2, Remat("full"), 64)
    assert full.kept == 0 and full.rebuilt == 2 * ((4 * 64 + 1) * A * h + 3 * 63 * A * f)
    assert full.rebuilt > 30e9  # more than a third of an 80 GB device, for one layer
    none = cfg.dispatch_parts(1, 4096, 2, Remat("none"), 64)
    assert none.kept == (58 + 1) * full.rebuilt  # 58 mixture layers and the MTP module's


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_two_hops_over_nodes_compute_what_one_hop_does(groups):
    """expert=4 as 2 nodes of 2 devices: each token sent once per node it
    needs, fanned out inside the node, summed there on the way back; the
    outputs and every gradient equal the one-hop dispatch's, with and
    without group-limited routing (4 groups of 2 experts, the best 2)."""
    ep, E, k, D, F, N = 4, 8, 3, 16, 8, 24
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(ep * N, D)), jnp.float32)
    routing = moe.route(jnp.asarray(rng.normal(size=(ep * N, E)), jnp.float32), k, True,
                        groups=groups)
    w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
         for s in ((E, D, F), (E, D, F), (E, F, D))]

    def run(node):
        def body(x, weights, experts, *w):
            r = moe.Routing(weights, experts, None, None)
            return moe.dropless(x, r, *w, E, "expert", ep, moe.Kernels("tiled", "padded",
                                                                      node=node))

        f = jax.shard_map(body, mesh=_mesh(ep), in_specs=(P("expert"),) * 6,
                          out_specs=P("expert"))
        loss = lambda x, weights, *w: jnp.sum(jnp.sin(f(x, weights, routing.experts_Nxk, *w)))
        return f(x, routing.weights_Nxk, routing.experts_Nxk, *w), jax.grad(
            loss, argnums=(0, 1, 2, 3, 4))(x, routing.weights_Nxk, *w)

    (one, one_grads), (two, two_grads) = run(0), run(2)
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5)
    for a, b in zip(two_grads, one_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_an_expert_axis_over_nodes_dispatches_in_two_hops(corpus):
    """meshes/cpu-2x4-experts.toml ([ici] expert=2, [dcn] expert=2): auto
    takes two hops, 2 devices a node; direct takes one; two-hop on an axis
    inside one node is refused before compiling, naming the sizes."""
    def job(mesh, dispatch):
        return make_job(corpus, model="deepseek-tiny", mesh=mesh, expert_dispatch=dispatch)

    assert job(str(ROOT / "meshes/cpu-2x4-experts.toml"), "auto").hooks.expert_node == 2
    assert job(str(ROOT / "meshes/cpu-2x4-experts.toml"), "direct").hooks.expert_node == 0
    assert job("expert=4,data=2", "auto").hooks.expert_node == 0
    with pytest.raises(ConfigError, match="two-hop: the expert axis \\(4 devices\\) is on one node"):
        job("expert=4,data=2", "two-hop")


def test_the_memory_report_counts_the_dispatch_buffers_too(corpus):
    """A run's analytic activation figure (the memory report's) adds the
    dispatch's worst-case buffers over `expert`, as the planner does."""
    job = make_job(corpus, model="deepseek-tiny", mesh="expert=4,data=2")
    cfg, t = job.model.config, job.run.train
    rows = t.batch_size // t.microbatches // 8
    args = (rows, job.run.data.seq_len, 4, job.hooks.remat)
    parts, extra = cfg.activation_parts(*args), cfg.dispatch_parts(*args, 4)
    assert extra.kept + extra.rebuilt > 0
    assert job.activation_estimate() == pytest.approx(
        parts.kept + extra.kept + max(parts.rebuilt + extra.rebuilt, parts.head))


def test_tiled_traces_inside_shard_map_over_two_axes():
    """Counts that vary over two manual axes (data and expert, as a step's
    dispatch sees them): the tiles and both loops trace and differentiate,
    the weights' gradient summed over both, equal to ragged_dot's."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "expert"))
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(4 * 12, 6)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 3, size=(4 * 12,)), jnp.int32)
    w = jnp.asarray(rng.normal(size=(3, 6, 5)), jnp.float32)

    def loss(gemm):
        def body(x, ids, w):
            order = jnp.argsort(ids, stable=True)
            counts = jnp.zeros((3,), jnp.int32).at[ids].add(1)
            product = grouped.product(gemm, counts, x.shape[0])
            return jnp.sum(jnp.sin(product(x[order], w)))[None]
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(("data", "expert")),) * 2 + (P(),),
                          out_specs=P(("data", "expert")))
        return lambda x, w: jnp.sum(f(x, ids, w))

    for got, want in zip(jax.grad(loss("tiled"), (0, 1))(x, w),
                         jax.grad(loss("ragged_dot"), (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
