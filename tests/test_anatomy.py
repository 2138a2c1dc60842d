"""scripts/anatomy.py's accounting of a profile: an op's time is its own,
not that of the ops nested in its event."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "anatomy.py"


def _anatomy():
    spec = importlib.util.spec_from_file_location("scripts_anatomy", SCRIPT)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(op, ts, dur, tid=1):
    return {"ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": {"hlo_op": op}}


def test_a_loop_event_counts_only_the_time_its_body_ops_do_not():
    """XLA:CPU's while op runs the body's first ops, and the wait in its first
    collective, inside its own event on its thread."""
    events = [_event("while", 0, 100), _event("slice", 10, 20), _event("all-gather", 40, 50),
              _event("nested", 45, 10), _event("after", 100, 5), _event("other", 0, 70, tid=2)]
    own = {e["args"]["hlo_op"]: us for e, us in _anatomy().self_times(events)}
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
    anatomy = _anatomy()
    table = anatomy.op_table(MODULE, layers=4)
    assert anatomy.category(*table["ynn_fusion.5"]) == "attention (forward)"
    assert anatomy.category(*table["norm"]) == "norms, activations, residuals (forward)"
