"""The layout search (zero_jax/planner/search.py): estimates ranked, the
best compiled in a worker process and cached, the cache keyed by the code."""

import concurrent.futures as cf
import dataclasses
import json

import pytest

import models
from zero_jax import config as config_lib
from zero_jax.planner import cost, search
from zero_jax.planner.choices import Choice, Cluster, Space, choices
from zero_jax.runtime import device_kinds

BASE = {"model.name": "gpt-tiny", "model.vocab_size": 256, "precision.policy": "fp32",
        "data.seq_len": 32, "train.batch_size": 16, "activations.remat": "full"}
NARROW = Space(stages=(1, 3), remats=("full",), micros=(2,), offloads=("",), quantized=(False,))


@pytest.fixture(scope="module")
def problem():
    build = models.for_run(config_lib.ModelConfig(name="gpt-tiny"), 256)[0]
    cluster = Cluster(device_kinds.load("a100-80gb"), 1, 8)
    return search.Problem(BASE, build, cluster, 256)


@pytest.fixture(scope="module")
def estimates(problem):
    layouts = choices(problem.build(1).config, problem.cluster, 16, NARROW)
    return search.estimate_all(problem, layouts)


def test_every_layout_is_estimated_and_ranked_fitting_and_fastest_first(problem, estimates):
    assert estimates and all(isinstance(e, cost.Estimate) for e in estimates)
    ranked = search.rank(estimates, {}, problem.cluster)
    assert [e.choice for e in ranked[:len(search.fitting(estimates))]] == [
        e.choice for e in search.fitting(estimates)]
    assert search.compile_best(problem, estimates, [], count=0, top=1, workers=1,
                               cache_dir=None) == {}
    label = ranked[-1].choice.label
    assert [e.choice.label for e in search.matching(estimates, [label])] == [label]


def test_measured_figures_replace_the_traffic_and_an_offload_twin_shares_them(problem, estimates):
    best = search.fitting(estimates)[0]
    twin = Choice(**{**best.choice.__dict__, "offload": "opt"})
    assert search.compiled_as(twin) == best.choice
    figures = {"argument_bytes": 1, "temp_bytes": 2, "collectives": {}, "collective_bytes": 0}
    (ranked,) = [e for e in search.rank([best], {best.choice: figures}, problem.cluster)]
    assert ranked.compiled == figures and ranked.time.step_s <= best.time.step_s
    failed = search.rank([best], {best.choice: {"error": "boom"}}, problem.cluster)[0]
    assert failed.compiled == {"error": "boom"} and failed.time.step_s == best.time.step_s


def test_the_best_layout_compiles_in_a_worker_and_is_cached(problem, estimates, tmp_path,
                                                            monkeypatch):
    results = search.compile_best(problem, estimates, [], count=1, top=1, workers=1,
                                  cache_dir=tmp_path)
    choice = search.fitting(estimates)[0].choice
    figures = results[choice]
    assert len(results) == 1
    assert figures["temp_bytes"] > 0 and figures["collective_bytes"] > 0, figures
    path = search.cache_path(tmp_path, choice.flat(BASE), 8, 256)
    assert json.loads(path.read_text()) == figures
    # A second search reads the cache: nothing is submitted to a worker.
    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")
    monkeypatch.setattr(cf.ProcessPoolExecutor, "submit", refuse)
    assert search.compile_best(problem, estimates, [], count=1, top=1, workers=1,
                               cache_dir=tmp_path) == results


def test_what_measuring_moves_into_the_top_is_compiled_next(problem, estimates, tmp_path,
                                                           monkeypatch):
    """The first layout's compiled traffic sinks it: the layouts that rise
    into the top two are compiled after it, and the budget bounds the loop."""
    fitting = search.fitting(estimates)
    first = fitting[0].choice
    light = {"argument_bytes": 1, "temp_bytes": 2, "collectives": {}, "collective_bytes": 0}
    heavy = {**light, "collectives": {"all-reduce@data": 1e15}, "collective_bytes": 1e15}
    for e in fitting:  # every figure cached: nothing compiles, the order alone is tested
        path = search.cache_path(tmp_path, e.choice.flat(BASE), 8, 256)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(heavy if e.choice == first else light))
    monkeypatch.setattr(cf.ProcessPoolExecutor, "submit",
                        lambda *a, **k: pytest.fail("compiled instead of read from the cache"))
    results = search.compile_best(problem, estimates, [], count=3, top=2, workers=1,
                                  cache_dir=tmp_path)
    ranked = search.rank(estimates, results, problem.cluster)
    assert first in results and len(results) == 3
    assert ranked.index(next(e for e in ranked if e.choice == first)) >= 2  # sunk
    assert search.compiled_top(ranked, 2) == 2
    assert [e.choice for e in ranked[:2]] == [c.choice for c in fitting[1:3]]
    spent = search.compile_best(problem, estimates, [], count=1, top=2, workers=1,
                                cache_dir=tmp_path)
    assert list(spent) == [first]  # a budget of one: the first, then the loop ends
    assert search.compiled_top(search.rank(estimates, spent, problem.cluster), 2) == 0


def test_the_code_version_hashes_every_subfolder(tmp_path, monkeypatch):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "deep.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = search.code_version(("pkg",))
    (tmp_path / "pkg" / "sub" / "deep.py").write_text("x = 2\n")
    assert search.code_version(("pkg",)) != before
    assert len(search.code_version()) == 12


def test_each_compiled_row_says_which_figure_bounds_which(estimates):
    e = search.fitting(estimates)[0]
    gb = e.peak_bytes

    def against(cpu_bytes, wider=""):
        figures = {"argument_bytes": 0, "temp_bytes": cpu_bytes}
        return cost.against_compiled(dataclasses.replace(e, compiled=figures), wider)

    assert cost.against_compiled(e) is None  # not compiled
    assert against(gb * 1.05) == "within 10%"
    assert against(gb * 0.5) == "GB bounds CPU GB"
    assert against(gb * 2, "bf16, scores") == "CPU GB bounds (bf16, scores)"
    assert against(gb * 2) == "GB may be low"
