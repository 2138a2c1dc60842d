"""Noticing that the run must stop (preemption, Ctrl-C), so the loop can save and exit.

One process: SIGTERM and SIGINT (Ctrl-C) each set a flag that the loop reads
after each step; no exception is raised into whatever code the signal lands
in (a KeyboardInterrupt inside an orbax save or a garbage-collector callback
in JAX is either a wall of tracebacks or lost). The step in flight ends, the
state is saved, and the run exits: 0 after SIGTERM, EXIT_INTERRUPTED after
Ctrl-C. A second Ctrl-C exits at once with one line (`interrupts`): a save
still writing is abandoned, which never commits (orbax writes a temporary
directory and renames it whole), and the checkpoints already committed are
untouched.

Several processes: once `jax.distributed` is initialised, SIGTERM no longer
ends a process; JAX's preemption service hears it (on any one process) and
`reached_preemption_sync_point` tells every process, at the same step, that
it is time to save. Ctrl-C is passed on to it as a SIGTERM, so that every
process stops at the same step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

import jax
from jax.experimental import multihost_utils

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


class _Interrupts:
    """What Ctrl-C has asked of this process, while `interrupts` handles it."""

    def __init__(self):
        self.count = 0  # SIGINTs received
        self.depth = 0  # nested `interrupts` contexts
        self.forward = False  # several processes: Ctrl-C becomes a preemption (SIGTERM)
        self.second_line: Callable[[], str] = _before_training


def _before_training() -> str:
    return "interrupted again: stopped at once, before training began; nothing was saved"


_state = _Interrupts()


@contextlib.contextmanager
def interrupts(second_line: Callable[[], str] | None = None) -> Iterator[None]:
    """Inside: Ctrl-C sets the flag `interrupted` reads instead of raising
    KeyboardInterrupt. A second Ctrl-C prints `second_line()` (which step is
    restorable) on stderr and exits with EXIT_INTERRUPTED at once. Nested
    contexts keep one handler; the inner `second_line` holds while inside.
    Outside the main thread (where signals cannot be handled) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_line = _state.second_line
    previous = signal.signal(signal.SIGINT, _on_sigint) if _state.depth == 0 else None
    _state.depth += 1
    if second_line is not None:
        _state.second_line = second_line
    try:
        yield
    finally:
        _state.depth -= 1
        _state.second_line = previous_line
        if _state.depth == 0:
            if previous is not None:  # None: a handler not set from Python; the default stays
                signal.signal(signal.SIGINT, previous)
            _state.count, _state.forward = 0, False


def interrupted() -> bool:
    """Whether Ctrl-C has been pressed inside `interrupts`."""
    return _state.count > 0


def _on_sigint(signum, frame) -> None:
    _state.count += 1
    if _state.count > 1:
        try:
            line = _state.second_line()
        except Exception as e:  # noqa: BLE001 - the exit must happen whatever the line does
            line = f"interrupted again: stopped at once ({type(e).__name__} saying where)"
        exit_now(line)
    if _state.forward:
        os.kill(os.getpid(), signal.SIGTERM)


def exit_now(line: str, status: int = EXIT_INTERRUPTED) -> None:
    """Print `line` on stderr and end the process now: no exception unwinds
    through the code the signal interrupted, no thread is waited for."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - interrupted mid-write: what is buffered is lost
            pass
    os.write(2, (line + "\n").encode())
    os._exit(status)


class Preemption:
    """Whether, and why, the run must stop after a step."""

    def __init__(self):
        self._flag = False
        self._processes = jax.process_count()
        if self._processes == 1:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        else:
            # JAX's preemption service hears SIGTERM and picks the step every
            # process stops at; a Ctrl-C already pressed is passed on now.
            _state.forward = True
            if interrupted():
                os.kill(os.getpid(), signal.SIGTERM)

    def _on_sigterm(self, signum, frame):
        self._flag = True

    def reason(self, step: int) -> str:
        """Whether to stop after `step`: "interrupted" (Ctrl-C, one process),
        "preempted" (SIGTERM; on several processes either signal, at the same
        step on every one), or "" to go on."""
        if self._processes > 1:
            return "preempted" if multihost_utils.reached_preemption_sync_point(step) else ""
        return self.now()

    def now(self) -> str:
        """`reason` as this process has it now, without a sync point: for
        one process only (a stop asked for while a save was being written)."""
        if self._processes == 1 and interrupted():
            return "interrupted"
        return "preempted" if self._flag else ""
