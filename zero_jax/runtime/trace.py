"""`--profile-steps A:B`: a jax.profiler trace of steps A to B - 1.

Steps are numbered as in the metrics file (step n is the n-th optimizer
step). The trace starts with nothing in flight, so it holds exactly those
steps, and stops once the last of them has finished on every device. It is
written under DIR/plugins/profile/<time>/ as an XPlane file (TensorBoard's
profile plugin, xprof) and a Perfetto trace (`*.trace.json.gz`, opened at
ui.perfetto.dev).
"""

from __future__ import annotations

from pathlib import Path

import jax

from zero_jax.config.sections import Window




class Tracer:
    """Starts and stops one trace around a window of steps."""

    def __init__(self, window: Window | None, directory: str, log=print):
        self.window, self.directory, self.log = window, directory, log
        self.active = False

    def at_edge(self, index: int) -> bool:
        """True if the trace starts or stops before the step of 0-based
        `index` (numbered index + 1) is dispatched."""
        return self.window is not None and (
            (not self.active and index + 1 == self.window.first)
            or (self.active and index + 1 == self.window.stop))

    def toggle(self) -> None:
        if self.active:
            self.stop()
        else:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def stop(self) -> None:
        if not self.active:
            return
        jax.profiler.stop_trace()
        self.active = False
        traces = sorted(Path(self.directory).glob("plugins/profile/*/perfetto_trace.json.gz"))
        where = traces[-1] if traces else Path(self.directory)
        self.log(f"profile of steps {self.window.first}-{self.window.stop - 1} written: {where} "
                 "(open it at ui.perfetto.dev, or run tensorboard --logdir "
                 f"{self.directory} and choose Profile)")
