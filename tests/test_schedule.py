"""Pipeline schedule tables and their compiled programs (no JAX)."""

import numpy as np
import pytest

from tests import schedule_oracle
from zero_jax.pipeline import schedule as schedule_lib
from zero_jax.pipeline.program import Program, Tables
from zero_jax.pipeline.schedule import W_PER_TICK

CASES = [(name, p, m, (2 if name == "interleaved" else 1))
         for name in schedule_lib.SCHEDULES for p in (2, 4) for m in (4, 8, 16)]


def _units(s):
    """The formulas' convention: a forward and a backward one unit each (a
    split backward's B and W half a unit each)."""
    return schedule_lib.cost(s, [1 / s.v] * s.chunks, schedule_lib.Prices(backward=1.0, weight=0.5))


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_tables_are_valid_and_bubbles_match_the_formulas(name, p, m, v):
    s = schedule_lib.build(name, p, m, v)
    assert schedule_oracle.violations(s) == []
    actions = [a for row in s.table for acts in row for a in acts]
    per = 3 if name == "zb-h1" else 2  # F and B (and W) per microbatch and chunk
    assert len(actions) == per * m * p * v
    bubble = _units(s).bubble
    if name == "zb-h1":  # below 1F1B's: Ws fill the ticks where stages would idle
        assert bubble < (p - 1) / (m + p - 1)
    elif v == 1 or m % p == 0:
        assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    peaks = s.stash_peak()
    if name == "gpipe":
        assert peaks == [m] * p  # every microbatch stashed before the first backward
    if name in ("1f1b", "zb-h1"):
        # A backward comes back 2 (p - d) - 1 ticks after its forward; the
        # last stage runs both in one tick.
        assert peaks == [min(m, 2 * (p - d) - 1) for d in range(p - 1)] + [1]


def test_idle_fractions_at_bloom_shape():
    """p = 12, m = 128, uniform stages, a backward three forwards (it
    recomputes the forward): fused ticks bring 1F1B to asynchronous 1F1B's
    (p - 1) / (m + p - 1); ZB-H1 below; interleaving over v = 2 although
    12 does not divide 128."""
    def idle(name, v=1):
        return schedule_lib.cost(schedule_lib.build(name, 12, 128, v), [1 / v] * (12 * v)).bubble
    assert idle("1f1b") == pytest.approx(11 / 139, abs=1e-3) and idle("1f1b") <= 0.09
    assert idle("zb-h1") <= 0.05
    assert idle("interleaved", 2) <= 0.06


def test_violations_catch_a_broken_table():
    s = schedule_lib.build("1f1b", 2, 4)
    rows = list(map(list, s.table))
    t_b = next(t for t, row in enumerate(rows) if any(a.kind == "B" for a in row[1]))
    rows[t_b][1], rows[0][1] = rows[0][1], rows[t_b][1]  # a backward before any forward
    broken = schedule_lib.Schedule(s.name, s.p, s.m, s.v, tuple(map(tuple, rows)))
    assert any("before" in v for v in schedule_oracle.violations(broken))


def test_chart_reads_as_a_tick_table():
    chart = schedule_lib.build("1f1b", 2, 3).chart().splitlines()
    assert chart == ["stage 0: F0 F1   F2B0 B1   B2", "stage 1: .  F0B0 F1B1 F2B2 ."]
    assert "F0a" in schedule_lib.build("interleaved", 2, 2, 2).chart()
    assert "W" in schedule_lib.build("zb-h1", 2, 3).chart()


@pytest.mark.parametrize("bad,message", [
    (("zigzag", 2, 4, 1), "choose from gpipe, 1f1b, interleaved, zb-h1"),
    (("gpipe", 2, 4, 2), "interleaved schedule only"),
])
def test_shapes_that_cannot_be_scheduled_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        schedule_lib.check_shape(*bad)


@pytest.mark.parametrize("name,p,m,v", CASES + [("interleaved", 4, 6, 2), ("zb-h1", 4, 6, 1)])
def test_program_buffers_deliver_each_message_to_its_reader(name, p, m, v):
    """Run the compiled program symbolically, in the loop's order: every
    buffer slot holds a label, and each forward must read its own input,
    each backward its own gradient, each W what its B kept; each message
    goes over its tick's pair list."""
    s = schedule_lib.build(name, p, m, v)
    prog = Program.of(s)
    n_stash, n_fwd, n_bwd, n_keep = prog.slots
    stash = [[None] * n_stash for _ in range(p)]
    fwd = [[None] * (n_fwd + 1) for _ in range(p)]
    bwd = [[None] * (n_bwd + 1) for _ in range(p)]
    keep = [[None] * n_keep for _ in range(p)]
    tables = Tables(prog, np.ones((p, v), np.int32))
    kept = {t for start, stop, k in tables.runs() if k for t in range(start, stop)}
    weights = 0  # Ws run: in a B's tick with it, or later from its W slot
    for t in range(s.ticks):
        to_next, to_prev = [None] * p, [None] * p
        for d in range(p):
            if prog.f[t, d]:
                mb, g = prog.f_mb[t, d], prog.f_chunk[t, d] * p + d
                x = ("embedding", mb) if prog.f_first[t, d] else fwd[d][prog.f_read[t, d]]
                assert x == (("embedding", mb) if g == 0 else ("act", mb, g)), (t, d, x)
                stash[d][prog.f_stash[t, d]] = ("act", mb, g)
                if prog.f_last[t, d]:
                    bwd[d][prog.f_dy[t, d]] = ("grad", mb, g)
                else:
                    to_next[(d + 1) % p] = ("act", mb, g + 1)
            if prog.b[t, d]:
                mb, g = prog.b_mb[t, d], prog.b_chunk[t, d] * p + d
                assert stash[d][prog.b_stash[t, d]] == ("act", mb, g), (t, d)
                assert bwd[d][prog.b_read[t, d]] == ("grad", mb, g), (t, d)
                weights += bool(prog.b_whole[t, d])
                if not prog.b_first[t, d]:
                    to_prev[(d - 1) % p] = ("grad", mb, g - 1)
            # The Ws read their slots, then (at a tick that uses the W
            # buffer) the B's taps are written, or zeros into a free slot.
            for j in range(W_PER_TICK):
                if prog.w[t, d, j]:
                    assert keep[d][prog.w_slot[t, d, j]][:2] == ("taps", prog.w_chunk[t, d, j])
                    keep[d][prog.w_slot[t, d, j]] = None
                    weights += 1
            if prog.b[t, d] and not prog.b_whole[t, d]:
                assert t in kept and keep[d][prog.b_keep[t, d]] is None, (t, d)
                keep[d][prog.b_keep[t, d]] = ("taps", prog.b_chunk[t, d], prog.b_mb[t, d])
            elif t in kept and prog.b_keep[t, d] < n_keep:
                assert keep[d][prog.b_keep[t, d]] is None, (t, d)  # zeros clobber nothing
        for d in range(p):
            fwd[d][prog.fwd_arrival[t, d]] = to_next[d]
            bwd[d][prog.bwd_arrival[t, d]] = to_prev[d]
            assert (to_next[d] is None) == (prog.fwd_arrival[t, d] == n_fwd)
            assert (to_prev[d] is None) == (prog.bwd_arrival[t, d] == n_bwd)
        senders = {i for i, x in enumerate(to_next) if x is not None}
        assert {b for _, b in prog.f_pairs[prog.f_send[t]]} == senders
        senders = {i for i, x in enumerate(to_prev) if x is not None}
        assert {b for _, b in prog.b_pairs[prog.b_send[t]]} == senders
    # One message per microbatch and chunk boundary, each way.
    assert prog.messages() == 2 * m * (p * v - 1)
    assert weights == m * p * v  # every chunk's weights, once per microbatch
    if s.split_backward:  # as many W slots as Ws wait at once, and a spare at most
        assert max(s.pending_w_peak()) <= n_keep <= max(s.pending_w_peak()) + 1
    if name == "1f1b":
        assert n_stash == min(m, 2 * p - 1)


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (4, 16)])
def test_gpipe_cost_bubble_is_the_formula_when_stages_are_even(p, m):
    """All forwards, then all backwards: each phase's ticks are uniform, so
    pricing a backward at three forwards leaves (p - 1) / (m + p - 1) idle."""
    c = schedule_lib.cost(schedule_lib.build("gpipe", p, m), [1] * p)
    assert c.total == pytest.approx(4 * (m + p - 1))
    assert c.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_fused_one_f_one_b_runs_a_forward_and_a_backward_per_tick():
    """Worked by hand on the chart above: ticks 1 4 4 4 3 = 16 units, 24
    busy of 2 x 16, so a quarter of the time is idle: (p - 1) / (m + p - 1)."""
    s = schedule_lib.build("1f1b", 2, 3)
    c = schedule_lib.cost(s, [1, 1])
    assert c.ticks == (1, 4, 4, 4, 3) and c.busy == 24
    assert c.bubble == pytest.approx(0.25)
    # The head runs forward and backward in the last stage's forward; each
    # of the 5 ticks pays for its two sends, which run whether they carry a
    # message or not (6 of the 10 do).
    assert schedule_lib.cost(s, [1, 1], schedule_lib.Prices(head=0.5)).ticks[1] == 5.5
    assert schedule_lib.cost(s, [1, 1], schedule_lib.Prices(send=0.25)).total == pytest.approx(16 + 10 * 0.25)


@pytest.mark.parametrize("p,m", [(4, 8), (12, 128)])
def test_zero_bubble_steady_state_keeps_nothing_for_later(p, m):
    """zb-h1 runs each B's own W with it where the tick has room: only the Ws
    deferred while the pipeline fills wait, and the ticks in between (most
    of them at m >> p) neither keep nor read a W's inputs; the bubble is the
    same as deferring every W in turn."""
    s = schedule_lib.build("zb-h1", p, m)
    tables = Tables(Program.of(s), np.ones((p, 1), np.int32))
    kept = sum(stop - start for start, stop, k in tables.runs() if k)
    assert kept <= 3 * (p - 1) + 1, tables.runs()
    assert s.pending_w_peak() == [2 * d for d in range(p)]
    if (p, m) == (12, 128):
        assert schedule_lib.cost(s, [1.0] * p).bubble <= 0.05


def test_a_waiting_w_holds_every_products_input_and_output_gradient(corpus):
    """What the planner counts per waiting W, per token and layer: for GPT
    16 d_model (qkv d + 3d, out d + d, fc d + 4d, proj 4d + d); for Llama
    7 D + 2 H Q + 2 K Q + 3 F (q, k, v each read the block's input; o, gate,
    up, down)."""
    from tests.helpers import make_job
    from zero_jax.planner import step_bytes

    gpt = make_job(corpus, mesh="fsdp=8")
    assert step_bytes._kept_per_token(gpt) == 16 * gpt.model.config.d_model
    llama = make_job(corpus, model="llama-tiny", mesh="fsdp=8")
    c = llama.model.config
    D, HQ, KQ, F = c.d_model, c.n_head * c.q_dim, c.n_kv_head * c.q_dim, c.d_mlp
    assert step_bytes._kept_per_token(llama) == 7 * D + 2 * HQ + 2 * KQ + 3 * F
