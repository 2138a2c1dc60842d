"""The step anatomy's accounting of a profile (zero_jax/report/anatomy.py):
an op's time is its own, not that of the ops nested in its event."""

from __future__ import annotations

from zero_jax.report import anatomy


def _event(op, ts, dur, tid=1):
    return {"ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": {"hlo_op": op}}


def test_a_loop_event_counts_only_the_time_its_body_ops_do_not():
    """XLA:CPU's while op runs the body's first ops, and the wait in its first
    collective, inside its own event on its thread."""
    events = [_event("while", 0, 100), _event("slice", 10, 20), _event("all-gather", 40, 50),
              _event("nested", 45, 10), _event("after", 100, 5), _event("other", 0, 70, tid=2)]
    own = {e["args"]["hlo_op"]: us for e, us in anatomy.self_times(events)}
    assert own == {"while": 30, "slice": 20, "all-gather": 40, "nested": 10, "after": 5,
                   "other": 70}
    assert sum(own.values()) == 175  # the union of busy time per thread: 105 + 70


MODULE = """\
%fused_computation.5 (param_0: f32[2,4,4], param_1: f32[2,4,4]) -> f32[2,4] {
  %param_0 = f32[2,4,4]{2,1,0} parameter(0)
  %param_1 = f32[2,4,4]{2,1,0} parameter(1)
  %dot.1 = f32[2,4,4]{2,1,0} dot(%param_0, %param_1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, metadata={op_name="jit(train_step)/jvp(GPT)/blocks/bthq,bshq->bhts/dot_general"}
  %c = f32[] constant(0)
  ROOT %reduce_sum.1 = f32[2,4]{1,0} reduce(%dot.1, %c), dimensions={2}, to_apply=%add, metadata={op_name="jit(train_step)/jvp(GPT)/blocks/reduce_sum"}
}

ENTRY %main (a: f32[2,4,4], b: f32[2,4,4]) -> f32[2,4] {
  %a = f32[2,4,4]{2,1,0} parameter(0)
  %b = f32[2,4,4]{2,1,0} parameter(1)
  %norm = f32[2,4,4]{2,1,0} add(%a, %b), metadata={op_name="jit(train_step)/jvp(GPT)/blocks/ln_1/add"}
  ROOT %ynn_fusion.5 = f32[2,4]{1,0} fusion(%norm, %b), kind=kCustom, calls=%fused_computation.5, metadata={op_name="jit(train_step)/jvp(GPT)/blocks/reduce_sum"}
}
"""


def test_a_fusion_with_a_product_in_it_is_the_products():
    """XLA:CPU fuses the softmax into the scores' product under the softmax's
    reduce_sum metadata: the fusion is attention, not a norm."""
    table = anatomy.op_table(MODULE, layers=4)
    assert anatomy.category(*table["ynn_fusion.5"]) == "attention (forward)"
    assert anatomy.category(*table["norm"]) == "norms, activations, residuals (forward)"


PIPE = "jit(train_step)/shard_map/while/body/closed_call/cond/branch_1_fun/"


def test_a_pipeline_stage_is_counted_as_the_model_in_each_pass():
    """A pipeline runs its stage's forward under a bare jvp() (the loss's own
    ops sit there too, one level down), rebuilds it in the backward tick
    under the stage's checkpoint without any jvp, then transposes it; the
    tick loop around them is the schedule, not the optimizer."""
    category = anatomy.category
    assert category("fusion", PIPE + "jvp()/while/body/closed_call/Block/btd,df->btf/dot_general") \
        == "matmuls (forward)"
    assert category("fusion", PIPE + "while/body/closed_call/checkpoint/Block/btd,df->btf/"
                    "dot_general") == "matmuls (backward)"
    assert category("fusion", PIPE + "transpose(jvp())/while/body/closed_call/checkpoint/Block/"
                    "bhts,bshq->bthq/dot_general") == "attention (backward)"
    assert category("fusion", PIPE + "while/body/jit(dynamic_index_in_dim)/dynamic_slice") \
        == "scan slicing/stacking"
    assert category("fusion", PIPE + "jvp(GPT.head)/btd,vd->btv/dot_general") == \
        "loss head (forward)"
    assert category("fusion", PIPE + "GPT.embed/jit(_take)/select_n") == "embedding (forward)"
    assert category("select", PIPE.removesuffix("cond/branch_1_fun/")) == "pipeline schedule"
    assert category("collective-permute", PIPE + "ppermute") == "collectives"
    # Without a pipeline the same rules give what they gave.
    assert category("fusion", "jit(train_step)/jvp()/exp") == "loss head (forward)"
    assert category("fusion", "jit(train_step)/transpose(jvp())/mul") == "loss head (backward)"
    assert category("fusion", "jit(train_step)/blocks/le") == "attention (forward)"  # mask, hoisted
    assert category("fusion", "jit(train_step)/jit(_where)/select_n") == \
        "optimizer, gradient norm, step"
    assert category("fusion", "jit(train_step)/transpose(jvp(GPT))/GPT.stack/while/body/"
                    "closed_call/checkpoint/blocks/btf,df->btd/dot_general") == "matmuls (backward)"


STAGE_FILL = """\
ENTRY %main (a: f32[]) -> f32[2,4,4] {
  %constant.1 = f32[] constant(0)
  ROOT %wrapped_broadcast.26 = f32[2,4,4]{2,1,0} fusion(%constant.1), kind=kLoop, calls=%w, metadata={op_name="jit(train_step)/shard_map/while/body/closed_call"}
  %while.3 = (s32[]) while(%t), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"2"}}
}
"""


def test_a_stage_stack_zero_fill_is_the_scans():
    """A pipeline stage scans its share of the layers (2 of 4 here): the
    zero-fill of a buffer stacked over a loop's trip count is stacking."""
    table = anatomy.op_table(STAGE_FILL, layers=4)
    assert table["wrapped_broadcast.26"][2]
    assert anatomy.category(*table["wrapped_broadcast.26"]) == "scan slicing/stacking"
    assert not anatomy.op_table(STAGE_FILL.replace('"n":"2"', '"n":"3"'), layers=4)[
        "wrapped_broadcast.26"][2]
