"""A step that takes far longer than the recent ones: report it, and past a
limit stop the process, instead of waiting forever on a peer that is stuck.

A hung collective blocks the main thread inside XLA, where no Python
exception can reach it, so the watchdog runs on its own thread and stops
the process with `os._exit`. A launcher or cluster scheduler then ends the
other processes; the last complete checkpoint is untouched.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import Callable, TextIO

EXIT_STUCK = 5


class StepWatchdog:
    """`started(step)` when the host starts on a step, `finished(step)` once
    it is done on every device.

    A step under way for more than `warn` times the median of the last
    `window` steps (and at least `min_s` seconds) is reported once; past
    `stop` times (0: never) the process exits with EXIT_STUCK.
    """

    def __init__(self, warn: float, stop: float, min_s: float, window: int = 20,
                 out: TextIO = sys.stderr, exit_fn: Callable[[int], None] = os._exit,
                 poll_s: float = 0.5, who: str = ""):
        self.warn, self.stop, self.min_s = warn, stop, min_s
        self._times: deque[float] = deque(maxlen=window)
        self._out, self._exit, self._poll, self._who = out, exit_fn, poll_s, who
        self._lock = threading.Lock()
        self._current: tuple[int, float, bool] | None = None  # (step, since, resumed)
        self._warned = -1
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="step-watchdog")
        self._thread.start()

    def started(self, step: int, resumed: bool = False) -> None:
        """`resumed`: the step was under way before a pause (a save), so only
        what remains of it is timed: watched, but not a sample of the
        median, which such partial times would pull down."""
        with self._lock:
            self._current = (step, time.monotonic(), resumed)

    def finished(self, step: int) -> None:
        with self._lock:
            if self._current is not None and self._current[0] == step and not self._current[2]:
                self._times.append(time.monotonic() - self._current[1])
            self._current = None

    def idle(self) -> None:
        """No step is under way, or what runs is not one (a save, a trace being
        written, the loop has ended): nothing to watch."""
        with self._lock:
            self._current = None

    def close(self) -> None:
        self._done.set()

    def limits(self) -> tuple[float, float] | None:
        """(report after, stop after) in seconds; None until 3 steps are known."""
        if len(self._times) < 3:
            return None
        median = statistics.median(self._times)
        stop = max(self.min_s, self.stop * median) if self.stop > 0 else float("inf")
        return max(self.min_s, self.warn * median), stop

    def _watch(self) -> None:
        while not self._done.wait(self._poll):
            with self._lock:
                current, limits = self._current, self.limits()
                median = statistics.median(self._times) if self._times else 0.0
            if current is None or limits is None:
                continue
            step, since, _ = current
            waited = time.monotonic() - since
            if waited > limits[1]:
                print(f"error: {self._who}step {step + 1} has run {_seconds(waited)}, over "
                      f"{self.stop:g} x the median step ({median:.2f} s); a peer is stuck or "
                      "dead. Stopping; resume from the last checkpoint.",
                      file=self._out, flush=True)
                self._exit(EXIT_STUCK)
                return
            if waited > limits[0] and self._warned != step:
                self._warned = step
                print(f"warning: {self._who}step {step + 1} has run {_seconds(waited)}, "
                      f"{waited / median:.0f} x the median step ({median:.2f} s)",
                      file=self._out, flush=True)


def _seconds(s: float) -> str:
    """A wait as the line says it: to the hundredth under ten seconds (a
    0.45 s step over 3 x a 0.14 s median is not "0 s"), whole seconds above."""
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"
