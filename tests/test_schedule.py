"""Pipeline schedule tables and their compiled programs (no JAX)."""

import pytest

from zero_jax.pipeline import schedule as sched
from zero_jax.pipeline.program import FWD, NOP, Program

CASES = [(name, p, m, (2 if name == "interleaved" else 1))
         for name in sched.SCHEDULES for p in (2, 4) for m in (4, 8, 16)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_tables_are_valid_and_bubbles_match_the_formulas(name, p, m, v):
    s = sched.build(name, p, m, v)
    assert sched.violations(s) == []
    actions = [a for row in s.table for a in row if a is not None]
    assert len(actions) == 2 * m * p * v  # one F and one B per microbatch and chunk
    expected = (p - 1) / (m + p - 1) if v == 1 else (p - 1) / (v * m + p - 1)
    assert s.bubble == pytest.approx(expected, abs=1e-12)
    if name == "gpipe":
        assert s.max_in_flight() == m  # every microbatch stashed before the first backward
    if name == "1f1b":
        assert s.max_in_flight() == min(p, m)  # the point of 1F1B


def test_violations_catch_a_broken_table():
    s = sched.build("1f1b", 2, 4)
    rows = list(map(list, s.table))
    t_b = next(t for t, row in enumerate(rows) if row[1] is not None and row[1].kind == "B")
    rows[t_b][1], rows[0][1] = rows[0][1], rows[t_b][1]  # a backward before any forward
    broken = sched.Schedule(s.name, s.p, s.m, s.v, tuple(map(tuple, rows)))
    assert any("before" in v for v in sched.violations(broken))


def test_chart_reads_as_a_tick_table():
    chart = sched.build("1f1b", 2, 3).chart().splitlines()
    assert chart == ["stage 0: F0 F1 .  B0 F2 B1 .  B2", "stage 1: .  F0 B0 F1 B1 F2 B2 ."]
    assert "F0a" in sched.build("interleaved", 2, 2, 2).chart()


@pytest.mark.parametrize("bad,message", [
    (("zigzag", 2, 4, 1), "choose from gpipe, 1f1b, interleaved"),
    (("interleaved", 2, 3, 2), "divisible by pipe"),
    (("gpipe", 2, 4, 2), "interleaved schedule only"),
])
def test_shapes_that_cannot_be_scheduled_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        sched.check_shape(*bad)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_program_buffers_deliver_each_message_to_its_reader(name, p, m, v):
    """Run the compiled program symbolically: every buffer slot holds a label,
    and each forward must read its own input, each backward its own gradient."""
    s = sched.build(name, p, m, v)
    prog = Program.of(s)
    G = p * v
    n_stash, n_fwd, n_bwd = prog.slots
    stash = [[None] * n_stash for _ in range(p)]
    fwd = [[None] * (n_fwd + 1) for _ in range(p)]
    bwd = [[None] * (n_bwd + 1) for _ in range(p)]
    for t in range(s.ticks):
        to_next, to_prev = [None] * p, [None] * p
        for d in range(p):
            kind, mb, k = prog.kind[t, d], prog.mb[t, d], prog.chunk[t, d]
            g = k * p + d
            if kind == NOP:
                continue
            if kind == FWD:
                x = ("embedding", mb) if prog.first[t, d] else fwd[d][prog.read[t, d]]
                assert x == (("embedding", mb) if g == 0 else ("act", mb, g)), (t, d, x)
                stash[d][prog.stash[t, d]] = ("act", mb, g)
                if prog.last[t, d]:
                    bwd[d][prog.dy[t, d]] = ("grad", mb, g)
                else:
                    to_next[(d + 1) % p] = ("act", mb, g + 1)
            else:
                assert stash[d][prog.stash[t, d]] == ("act", mb, g), (t, d)
                assert bwd[d][prog.read[t, d]] == ("grad", mb, g), (t, d)
                if not prog.first[t, d]:
                    to_prev[(d - 1) % p] = ("grad", mb, g - 1)
        for d in range(p):
            fwd[d][prog.fwd_arrival[t, d]] = to_next[d]
            bwd[d][prog.bwd_arrival[t, d]] = to_prev[d]
            assert (to_next[d] is None) == (prog.fwd_arrival[t, d] == n_fwd)
            assert (to_prev[d] is None) == (prog.bwd_arrival[t, d] == n_bwd)
    if name == "1f1b":
        assert n_stash == min(p, m)
    assert G == s.chunks


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (4, 16)])
def test_gpipe_cost_bubble_is_the_formula_when_stages_are_even(p, m):
    """All forwards, then all backwards: each phase's ticks are uniform, so
    pricing a backward at three forwards leaves (p - 1) / (m + p - 1) idle."""
    c = sched.cost(sched.build("gpipe", p, m), [1] * p)
    assert c.total == pytest.approx(4 * (m + p - 1))
    assert c.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_lockstep_one_f_one_b_pays_for_mixing_forwards_and_backwards():
    """Worked by hand on the chart above: ticks 1 1 3 3 3 3 3 3 = 20 units,
    24 busy of 2 x 20, so 0.4 of the time is idle, against 0.25 of the ticks."""
    s = sched.build("1f1b", 2, 3)
    c = sched.cost(s, [1, 1])
    assert c.ticks == (1, 1, 3, 3, 3, 3, 3, 3) and c.busy == 24
    assert c.bubble == pytest.approx(0.4) and s.bubble == pytest.approx(0.25)
    # The head runs forward and backward in the last stage's forward tick;
    # sends add to every tick.
    assert sched.cost(s, [1, 1], head=0.5).ticks[1] == 2.5
    assert sched.cost(s, [1, 1], send=0.25).total == pytest.approx(20 + 8 * 0.25)
