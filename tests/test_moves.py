"""What a compiled step moves without computing (analysis/moves.py): the
census of a hand-written module, and of gpt-tiny's train step, where the
copies removed from it must stay removed."""

import jax
import pytest

from tests.helpers import make_job
from zero_jax.analysis import moves

MODULE = """\
HloModule m

%dus_body (p0: f32[4,8,16], p1: f32[8,16], p2: s32[]) -> f32[4,8,16] {
  %p0 = f32[4,8,16]{2,1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %b = f32[1,8,16]{2,1,0} bitcast(%p1)
  ROOT %d = f32[4,8,16]{2,1,0} dynamic-update-slice(%p0, %b, %p2, %c, %c)
}

%slice_t_body (q0: f32[4,8,16], q1: s32[]) -> f32[16,8] {
  %q0 = f32[4,8,16]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %three = s32[] constant(3)
  %i = s32[] subtract(%three, %q1)
  %z = s32[] constant(0)
  %s = f32[1,8,16]{2,1,0} dynamic-slice(%q0, %i, %z, %z), dynamic_slice_sizes={1,8,16}
  %r = f32[8,16]{1,0} bitcast(%s)
  ROOT %t = f32[16,8]{1,0} transpose(%r), dimensions={1,0}
}

%add_body (a0: f32[8,16], a1: f32[8,16]) -> f32[8,16] {
  %a0 = f32[8,16]{1,0} parameter(0)
  %a1 = f32[8,16]{1,0} parameter(1)
  ROOT %a = f32[8,16]{1,0} add(%a0, %a1)
}

%fill_body (f0: f32[]) -> f32[4,8,16] {
  %f0 = f32[] parameter(0)
  ROOT %bc = f32[4,8,16]{2,1,0} broadcast(%f0), dimensions={}
}

%body (w: (s32[], f32[8,16], f32[4,8,16])) -> (s32[], f32[8,16], f32[4,8,16]) {
  %w = (s32[], f32[8,16]{1,0}, f32[4,8,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%w), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%w), index=1
  %ys = f32[4,8,16]{2,1,0} get-tuple-element(%w), index=2
  %sum = f32[8,16]{1,0} fusion(%x, %x), kind=kLoop, calls=%add_body
  %stacked = f32[4,8,16]{2,1,0} fusion(%ys, %sum, %i), kind=kLoop, calls=%dus_body, metadata={op_name="stack/dynamic_update_slice"}
  %back = f32[16,8]{1,0} fusion(%stacked, %i), kind=kLoop, calls=%slice_t_body
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,16]{1,0}, f32[4,8,16]{2,1,0}) tuple(%next, %sum, %stacked)
}

%cond (c: (s32[], f32[8,16], f32[4,8,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}, f32[4,8,16]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (x0: f32[8,16]) -> f32[4,8,16] {
  %x0 = f32[8,16]{1,0} parameter(0)
  %zero = f32[] constant(0)
  %zeros = f32[4,8,16]{2,1,0} fusion(%zero), kind=kLoop, calls=%fill_body
  %start = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, f32[4,8,16]{2,1,0}) tuple(%start, %x0, %zeros)
  %loop = (s32[], f32[8,16]{1,0}, f32[4,8,16]{2,1,0}) while(%init), condition=%cond, body=%body
  %copied = f32[8,16]{1,0} copy(%x0)
  ROOT %res = f32[4,8,16]{2,1,0} get-tuple-element(%loop), index=2
}
"""


def test_each_move_is_counted_per_execution_with_the_bytes_it_writes():
    found = {m.name: m for m in moves.census(MODULE)}
    assert set(found) == {"stacked", "back", "zeros", "copied"}  # not the add: it computes
    update = 8 * 16 * 4
    assert (found["stacked"].kind, found["stacked"].times, found["stacked"].bytes) == (
        "dynamic-update-slice", 4, update)  # in place: the update, not the whole buffer
    assert found["stacked"].op_name == "stack/dynamic_update_slice"
    # A slice that transposes is a transpose; its index arithmetic is not compute.
    assert (found["back"].kind, found["back"].times, found["back"].bytes) == ("transpose", 4, update)
    assert (found["zeros"].kind, found["zeros"].times, found["zeros"].bytes) == ("fill", 1, 4 * update)
    assert (found["copied"].kind, found["copied"].times) == ("copy", 1)
    assert moves.by_kind(list(found.values())) == {
        "dynamic-update-slice": (4, 4 * update), "transpose": (4, 4 * update),
        "copy": (1, update), "fill": (1, 4 * update)}


@pytest.fixture(scope="module")
def step_moves(corpus):
    job = make_job(corpus, mesh="data=1", zero_stage=0, devices=jax.devices()[:1], batch_size=8,
                   seq_len=32)
    return job, moves.census(job.lower_train_step().compile().as_text())


def test_the_layer_scan_writes_each_kept_activation_once_per_layer(step_moves):
    job, found = step_moves
    stacked = [m for m in found if m.kind == "dynamic-update-slice"]
    assert stacked and {m.times for m in stacked} == {job.model.config.n_layer}


def test_no_zeros_of_the_scores_shape_and_no_transposed_activation_for_weight_gradients(step_moves):
    """The causal mask is a T x S bias, so no B x H x T x S zero tensor is
    filled for the backward; weight gradients contract the kept activation
    as laid out, so none is copied into a transposed [D, B T] layout."""
    job, found = step_moves
    c = job.model.config
    rows = 8 * 32
    scores = f"f32[8,{c.n_head},32,32]"
    assert not [m for m in found if m.kind == "fill" and m.type.startswith(scores)]
    transposed = {f"f32[{d},{rows}]" for d in (c.d_model, c.d_mlp, 3 * c.d_model)}
    assert not [m for m in found if m.kind == "transpose" and m.type.split("{")[0] in transposed]


def test_no_rounding_copies_of_what_the_backward_keeps(step_moves):
    """remat rounds each kept float32 activation to float32, a no-op that
    XLA:CPU ran as a copy of it (zero_jax/precision/rounding.py removes them)."""
    _, found = step_moves
    assert not [m for m in found if m.op_name.endswith("reduce_precision")]
