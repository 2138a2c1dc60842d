"""Noticing that the run must stop (preemption), so the loop can save and exit.

One process: SIGTERM sets a flag that the loop reads after each step. Several
processes: once `jax.distributed` is initialised, SIGTERM no longer ends a
process; JAX's preemption service hears it (on any one process) and
`reached_preemption_sync_point` tells every process, at the same step, that
it is time to save.
"""

from __future__ import annotations

import signal

import jax
from jax.experimental import multihost_utils


class Preemption:
    def __init__(self):
        self._flag = False
        if jax.process_count() == 1:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self._flag = True

    def requested(self, step: int) -> bool:
        """True (on every process, at the same step) once a stop was asked for."""
        if jax.process_count() > 1:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._flag
