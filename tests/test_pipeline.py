"""Pipeline parallelism over `pipe`: every schedule against the 1-device run,
in full 3D, with layer counts the stages divide and ones they do not, and
what the compiled step holds and sends.

gpt-tiny with 8 layers, so that p = 4 stages x v = 2 chunks divide it.
"""

import itertools
import os

import jax
import numpy as np
import pytest

from tests.helpers import assert_close, compile_step, first_step, host, initial_state, make_job, train
from tests.hlo_loops import inside_loops
from zero_jax.data import corpus as corpus_lib
from zero_jax.analysis import hlo

COMMON = dict(seq_len=16, batch_size=32, n_layer=8)
MESHES = {
    "pipe2-fsdp4": dict(mesh="pipe=2,fsdp=4"),
    "pipe2-fsdp2-tensor2": dict(mesh="pipe=2,fsdp=2,tensor=2", layout="fsdp_tp_sp"),
    "pipe4-data2": dict(mesh="pipe=4,data=2"),
}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
GRID = list(itertools.product(SCHEDULES, MESHES, (4, 8), (1, 3)))
# CI's time budget covers a ninth of the grid for one step: every schedule
# once, every mesh, both microbatch counts and both ZeRO stages (zb-h1's
# traffic checked below); and two ten-step runs (1f1b on
# pipe4-data2 at ZeRO-3, interleaved under SP). ZERO_JAX_FULL_GRID=1 runs all
# 36 of both.
FULL = bool(os.environ.get("ZERO_JAX_FULL_GRID"))
ONE = GRID if FULL else [
    ("gpipe", "pipe2-fsdp4", 4, 1), ("1f1b", "pipe2-fsdp2-tensor2", 8, 1),
    ("interleaved", "pipe4-data2", 4, 1), ("zb-h1", "pipe2-fsdp2-tensor2", 4, 3)]
TEN = GRID if FULL else [("1f1b", "pipe4-data2", 4, 3), ("interleaved", "pipe2-fsdp2-tensor2", 8, 1)]


def _job(corpus, schedule, mesh, m, zero, **extra):
    return make_job(corpus, **COMMON, **MESHES[mesh], pipeline_schedule=schedule,
                    microbatches=m, zero_stage=zero, **extra)


@pytest.fixture(scope="module")
def reference(corpus):
    """The non-pipelined run on one device: loss and gradients of step 0, ten steps."""
    job = make_job(corpus, **COMMON, mesh="fsdp=1", devices=jax.devices()[:1])
    loss, grads = host(first_step(job, corpus))
    losses, state = train(job, corpus)
    return loss, grads, losses, host(state.params)


@pytest.mark.parametrize("schedule,mesh,m,zero", ONE, ids=["-".join(map(str, c)) for c in ONE])
def test_one_step_loss_and_gradients_match_one_device(corpus, reference, schedule, mesh, m, zero):
    job = _job(corpus, schedule, mesh, m, zero)
    loss, grads = first_step(job, corpus)
    np.testing.assert_allclose(float(loss), reference[0], rtol=1e-5)
    assert_close(host(grads), reference[1])


@pytest.mark.parametrize("schedule,mesh,m,zero", TEN, ids=["-".join(map(str, c)) for c in TEN])
def test_ten_steps_match_one_device(corpus, reference, schedule, mesh, m, zero):
    job = _job(corpus, schedule, mesh, m, zero)
    losses, state = train(job, corpus)
    np.testing.assert_allclose(losses, reference[2], rtol=1e-5)
    assert_close(host(job.state_plan.saved_form(state).params), reference[3])


def test_gather_once_matches_and_leaves_no_gather_in_the_loop(corpus, reference):
    """ZeRO-3 with the stage's weights gathered once per step: same numbers,
    and no all-gather of a weight left inside the pipeline's tick loop (the
    embedding's backward still gathers its batch-sharded input gradient)."""
    gathers = {}
    for once in (False, True):
        job = _job(corpus, "1f1b", "pipe2-fsdp4", 4, 3, pipeline_gather_once=once)
        loss, grads = first_step(job, corpus)
        np.testing.assert_allclose(float(loss), reference[0], rtol=1e-5)
        assert_close(host(grads), reference[1])
        text = compile_step(job).as_text()
        weights = {tuple(a.shape[i:]) for a in jax.tree.leaves(job.state_plan.abstract.params)
                   for i in (0, 1)}
        gathers[once] = [c for c in hlo.collectives(inside_loops(text))
                         if c.op == "all-gather" and c.shape in weights]
    assert gathers[False], "ZeRO-3 gathers each stage's weights inside the loop"
    assert not gathers[True], [c.line[:160] for c in gathers[True]]


def _assert_only_the_embedding_crosses_pipe(job, text):
    """No all-gather over `pipe` inside the tick loop; outside it, together at
    most one copy of the parameters outside the layer stack (the embedding
    and head, stored split over `pipe`)."""
    mesh = job.state_plan.mesh
    over_pipe = lambda cs: [c for c in cs if c.op == "all-gather" and "pipe" in (c.axes(mesh) or ("pipe",))]
    in_loop = over_pipe(hlo.collectives(inside_loops(text)))
    assert not in_loop, [c.line[:200] for c in in_loop]
    outer = sum(np.prod(p.shape) for k, sub in job.state_plan.abstract.params.items() if k != "blocks"
                for p in jax.tree.leaves(sub))
    gathered = over_pipe(hlo.collectives(text))
    assert sum(np.prod(c.shape) for c in gathered) <= outer, [c.line[:200] for c in gathered]


# The traffic test below checks 1f1b's and zb-h1's permutes pair by pair;
# CI runs this one for interleaved (its sends wrap around the ring),
# ZERO_JAX_FULL_GRID=1 for all four.
TALK = SCHEDULES if FULL else ("interleaved",)


@pytest.mark.parametrize("schedule", TALK)
def test_stages_talk_by_collective_permute_over_pipe_only(corpus, schedule):
    """Activations and their gradients move by collective-permute between
    stages, inside the tick loop. No stage's activations or layers are gathered across stages:
    the only all-gathers over `pipe` are of the embedding and head, stored
    split over `pipe` and gathered once per step, outside the tick loop."""
    job = _job(corpus, schedule, "pipe4-data2", 4, 3)
    mesh = job.state_plan.mesh
    text = compile_step(job).as_text()
    found = hlo.collectives(inside_loops(text))
    coords = {int(i): c for c, i in np.ndenumerate(np.arange(mesh.devices.size).reshape(mesh.devices.shape))}
    pipe = list(mesh.axis_names).index("pipe")
    permutes = [c for c in found if c.op == "collective-permute"]
    assert permutes
    for c in permutes:
        for source, target in c.groups():
            differ = [i for i, (a, b) in enumerate(zip(coords[source], coords[target])) if a != b]
            assert differ in ([], [pipe]), c.line[:200]  # [] : a device keeps its part
    _assert_only_the_embedding_crosses_pipe(job, text)


# CI: zb-h1 (its own B and W ticks) under sequence parallelism, the case
# with the most kinds of transfer; ZERO_JAX_FULL_GRID=1 every schedule on
# pipe4-data2 and two on SP.
TRAFFIC = [("zb-h1", "pipe2-fsdp2-tensor2")]
if FULL:
    TRAFFIC += [("1f1b", "pipe2-fsdp2-tensor2"), ("1f1b", "pipe4-data2"), ("gpipe", "pipe4-data2"),
                ("interleaved", "pipe4-data2"), ("zb-h1", "pipe4-data2")]


@pytest.mark.parametrize("schedule,mesh", TRAFFIC)
def test_pipe_traffic_is_one_activation_per_route_and_tick(corpus, schedule, mesh):
    """What the compiled step moves over `pipe`: at every tick, one
    activation over each route forward and one gradient over each route
    back (program.py: the sends run outside any conditional), so a step
    moves `Program.transfers()` activations, of which the schedule's
    messages, 2 m (G - 1), carry one. Each collective-permute in the tick
    loop carries one activation of one device's rows (1/tensor of it under
    sequence parallelism), over the routes and nothing else."""
    from zero_jax.pipeline.program import Program
    m = 8
    job = _job(corpus, schedule, mesh, m, 1)
    mesh_ = job.state_plan.mesh
    text = inside_loops(compile_step(job).as_text())
    pipe = list(mesh_.axis_names).index("pipe")
    coord = {int(i): c for c, i in np.ndenumerate(np.arange(mesh_.devices.size).reshape(mesh_.devices.shape))}
    payload = {}  # pipe-coordinate pair list -> bytes per device
    for c in hlo.collectives(text):
        if c.op == "collective-permute":
            pairs = tuple(sorted({(coord[a][pipe], coord[b][pipe]) for a, b in c.groups()}))
            payload[pairs] = int(np.prod(c.shape)) * 4
    prog = Program.of(job.schedule)
    assert set(payload) == set(prog.routes())
    dp = mesh_.shape["data"] * mesh_.shape["fsdp"]
    sp = mesh_.shape["tensor"] if MESHES[mesh].get("layout") == "fsdp_tp_sp" else 1
    act = COMMON["batch_size"] // m // dp * COMMON["seq_len"] * job.model.config.d_model * 4 // sp
    assert set(payload.values()) == {act}
    assert prog.messages() == 2 * m * (job.schedule.chunks - 1)
    assert prog.transfers() >= prog.messages()


def test_one_f_one_b_memory_is_below_gpipe_and_flat_in_m(corpus, capsys):
    """Compiled temporaries with p = 4: 1f1b below gpipe at m = 8, flat from
    m = 8 to 32 at a fixed microbatch size, while gpipe's grow with m."""
    rows = 4  # per microbatch: 2 per data-parallel shard
    temp = {}
    for schedule, m in itertools.product(("gpipe", "1f1b"), (8, 32)):
        job = make_job(corpus, mesh="pipe=4,data=2", n_layer=8, seq_len=128, batch_size=rows * m,
                       pipeline_schedule=schedule, microbatches=m)
        # Memory only: compiled at the tests' quick LLVM level (buffers are assigned before it).
        temp[schedule, m] = job.compile_train_step().memory_analysis().temp_size_in_bytes
    d_model = job.model.config.d_model
    act = rows // 2 * 128 * d_model * 4  # one stage input, per device (fp32)
    with capsys.disabled():
        print(f"\npipe=4,data=2 temp bytes per device (one microbatch's stage input {act:,} B): "
              + ", ".join(f"{s} m={m}: {b:,}" for (s, m), b in temp.items()))
    assert temp["1f1b", 8] < temp["gpipe", 8]
    assert abs(temp["1f1b", 32] - temp["1f1b", 8]) <= 2 * act
    assert temp["gpipe", 32] - temp["gpipe", 8] >= 24 * act  # 24 more stashed inputs


# Layer counts the stages do not divide (pipeline/cut.py): 10 layers on 4 stages cut
# 2, 3, 3, 2 and 6 cut 1, 2, 2, 1 (the embedding and the head count as a layer
# each), padded to 3 and 2 slots per stage. CI trains one (the evaluation
# tests run 1f1b and interleaved forwards on 10 layers); ZERO_JAX_FULL_GRID=1
# all six.
UNEVEN = list(itertools.product(SCHEDULES, (10, 6)))
UNEVEN_CI = UNEVEN if FULL else [("interleaved", 6)]


@pytest.fixture(scope="module")
def uneven_reference(corpus):
    """Ten steps of the 10- and 6-layer models on one device."""
    out = {}
    for layers in sorted({n for _, n in UNEVEN_CI}):
        job = make_job(corpus, **{**COMMON, "n_layer": layers}, mesh="fsdp=1",
                       devices=jax.devices()[:1])
        losses, state = train(job, corpus)
        out[layers] = losses, host(state.params)
    return out


@pytest.mark.parametrize("schedule,layers", UNEVEN_CI, ids=[f"{s}-{n}" for s, n in UNEVEN_CI])
def test_uneven_stages_match_one_device(corpus, uneven_reference, schedule, layers):
    job = make_job(corpus, **{**COMMON, "n_layer": layers}, mesh="pipe=4,data=2",
                   pipeline_schedule=schedule, virtual_stages=1, microbatches=4, zero_stage=1)
    stages = job.state_plan.stages
    assert stages.counts == {10: (2, 3, 3, 2), 6: (1, 2, 2, 1)}[layers]
    assert job.state_plan.abstract.params["blocks"]["w_fc"].shape[0] == 4 * stages.slots
    losses, state = train(job, corpus)
    np.testing.assert_allclose(losses, uneven_reference[layers][0], rtol=1e-5)
    assert_close(host(job.state_plan.saved_form(state).params), uneven_reference[layers][1])


# Microbatches the stages do not divide, on a cut they do not divide either:
# 10 layers over pipe=4 (2, 3, 3, 2; interleaved: 8 chunks), m = 6, so
# interleaving runs a short last round. CI runs the schedule whose tables
# change most with m (zb-h1's program at m = 6 on 4 stages is run
# symbolically in test_schedule.py);
# ZERO_JAX_FULL_GRID=1 all four.
RAGGED = SCHEDULES if FULL else ("interleaved",)


@pytest.fixture(scope="module")
def ragged_reference(corpus):
    job = make_job(corpus, seq_len=16, batch_size=24, n_layer=10, mesh="fsdp=1",
                   devices=jax.devices()[:1])
    losses, state = train(job, corpus)
    return losses, host(state.params)


@pytest.mark.parametrize("schedule", RAGGED)
def test_microbatches_pipe_does_not_divide_match_one_device(corpus, ragged_reference, schedule):
    job = make_job(corpus, seq_len=16, batch_size=24, n_layer=10, mesh="pipe=4,data=2",
                   pipeline_schedule=schedule, microbatches=6, zero_stage=1)
    assert job.schedule.m % job.schedule.p and job.state_plan.stages.padded != 10
    losses, state = train(job, corpus)
    np.testing.assert_allclose(losses, ragged_reference[0], rtol=1e-5)
    assert_close(host(job.state_plan.saved_form(state).params), ragged_reference[1])


@pytest.mark.parametrize("bad,message", [
    (dict(mesh="pipe=8", n_layer=6), "6 layers cannot fill 8 stages"),
    (dict(mesh="pipe=2,fsdp=4", pipeline_schedule="zigzag"),
     "choose from gpipe, 1f1b, interleaved, zb-h1"),
])
def test_pipeline_shapes_are_checked_before_compiling(corpus, bad, message):
    from zero_jax.config import ConfigError
    with pytest.raises(ConfigError, match=message):
        make_job(corpus, **{**dict(seq_len=16, batch_size=24), **bad})


def _outer_bytes(state_plan):
    """Bytes per device of parameters, gradients and optimizer state outside the layer stack."""
    from jax.sharding import NamedSharding, PartitionSpec
    is_spec = lambda x: isinstance(x, PartitionSpec)
    total = 0
    for tree, specs in ((state_plan.abstract.params, state_plan.specs.params),
                        (state_plan.abstract_grads, state_plan.specs.grads),
                        (state_plan.abstract.opt_state, state_plan.specs.opt_state)):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=is_spec)):
            if leaf.shape and "blocks" not in jax.tree_util.keystr(path):
                shard = NamedSharding(state_plan.mesh, spec).shard_shape(leaf.shape)
                total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
    return total


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_embedding_and_head_are_stored_split_over_pipe(corpus, zero):
    """With pipe=4 each device stores a quarter of the embedding, head and
    their gradients and optimizer state (the LayerNorm's few hundred bytes,
    under min_shard_elements, stay whole)."""
    piped = make_job(corpus, mesh="pipe=4,data=2", zero_stage=zero, precision="bf16", n_layer=4,
                     batch_size=16)
    whole = make_job(corpus, mesh="data=2", zero_stage=zero, precision="bf16", n_layer=4,
                     batch_size=16, devices=jax.devices()[:2])
    ln = 2 * 192 * (4 + 4 + 8)  # ln_f scale and bias: params, grads, Adam moments (fp32)
    assert _outer_bytes(piped.state_plan) <= _outer_bytes(whole.state_plan) / 4 + ln


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_evaluation_runs_the_forwards_where_the_layers_are(corpus, schedule):
    """Evaluation through the schedule's forwards matches the 1-device loss
    (a vocabulary padded past its 65 entries included), and gathers nothing
    over `pipe`: the embedding's rows are looked up and the logits computed
    where they are stored, and only activations move between stages."""
    shape = dict(seq_len=16, batch_size=32, n_layer=10)
    job = make_job(corpus, **shape, mesh="pipe=4,fsdp=2", pipeline_schedule=schedule,
                   virtual_stages=2 if schedule == "interleaved" else 0, microbatches=4, zero_stage=3)
    ref = make_job(corpus, **shape, mesh="fsdp=1", devices=jax.devices()[:1])
    batch = lambda j: corpus_lib.global_batch(corpus, "val", 16, 32, 0, step=0,
                                            sharding=j.state_plan.batch_sharding)
    compiled = job.compile_eval_step()
    loss = float(compiled(initial_state(job).params, batch(job)))
    expected = float(ref.compile_eval_step()(initial_state(ref).params, batch(ref)))
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    found = hlo.collectives(compiled.as_text())
    mesh = job.state_plan.mesh
    gathers = [c for c in found if c.op == "all-gather" and "pipe" in (c.axes(mesh) or ("pipe",))]
    assert not gathers, [c.line[:200] for c in gathers]
    assert any(c.op == "collective-permute" for c in found)


def test_bfloat16_gradients_pipeline_compiles_and_trains(corpus):
    """bf16 gradients of the embedding and head are summed over `pipe`
    (in float32 on CPU, whose all-reduce promotion aborts on bf16 there)."""
    job = make_job(corpus, seq_len=16, batch_size=16, mesh="pipe=2,fsdp=4", microbatches=2,
                   zero_stage=1, precision="bf16", grad_dtype="bfloat16", steps=2)
    losses, _ = train(job, corpus)
    assert np.isfinite(losses).all()


def _primitives(jaxpr, out=None):
    """Every equation's (primitive name, output shapes), sub-jaxprs included."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        out.append((eqn.primitive.name, [tuple(v.aval.shape) for v in eqn.outvars]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitives(inner, out)
    return out


def test_split_backward_leaves_the_weights_to_w_and_w_runs_no_forward():
    """zb-h1's B gives dx and no matrix's gradient; its W runs one product
    per matrix from what B kept (vmapped over the chunk's layers) and
    nothing of the forward: no softmax, no GELU."""
    import flax.linen as nn
    from zero_jax.model.hooks import Hooks
    from zero_jax.pipeline.weight_grad import SplitBackward
    fns = make_job(corpus_lib.load("stdlib"), **COMMON, mesh="fsdp=1",
                   devices=jax.devices()[:1]).model
    stack = nn.unbox(fns.init(jax.random.key(0)))["blocks"]
    chunk = jax.tree.map(lambda a: a[:2], stack)
    x = jax.ShapeDtypeStruct((4, COMMON["seq_len"], fns.config.d_model), np.float32)
    hooks = Hooks()

    def run(c, x, h):
        return fns.pipeline.stage(c, x, h)[0]  # (output, per-layer statistics)

    split = SplitBackward(run, chunk, x, hooks)
    products = [p for p in split.products if p is not None]
    assert len(products) == 4  # w_qkv, w_o, w_fc, w_proj
    weight_shapes = {tuple(p.w.shape) for p in products}
    dy = np.ones(x.shape, np.float32)
    b = jax.make_jaxpr(lambda c, x, dy: split.input_grad(lambda c, x: run(c, x, hooks), c, x, dy))(
        chunk, np.zeros(x.shape, np.float32), dy)
    shapes = [o for name, outs in _primitives(b.jaxpr) if name == "dot_general" for o in outs]
    assert shapes and not [o for o in shapes if o in weight_shapes or o[1:] in weight_shapes]
    taps = split.taps()
    w = jax.make_jaxpr(lambda t: split.weight_grads(hooks, t))(taps)
    names = [name for name, _ in _primitives(w.jaxpr)]
    assert names.count("dot_general") == 4
    assert not {"exp", "tanh", "erf", "logistic"} & set(names)
