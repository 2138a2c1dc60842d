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
