"""On the CPU backend, keep the memory a step frees for the next step.

XLA:CPU allocates each execution's temporaries (the compiled program's
`temp_size_in_bytes`: 341 MiB for gpt-tiny's step on one device) as one
block with plain `malloc`, from the worker thread that runs the program.
glibc serves a block that large from a fresh `mmap` whenever the calling
thread has its own arena (a thread arena cannot hold it), and unmaps it on
`free`, so every step faults its temporaries in page by page again:
~88,000 minor page faults per step, most of the zero-fills the step anatomy
shows. XLA:GPU's allocator (BFC, over memory JAX preallocates) reuses its
blocks; this makes the host do the same: one arena, large blocks from the
heap rather than from `mmap`, and a freed top of heap kept instead of
returned to the kernel. The process's resident memory then stays at its
peak, which a step reaches anyway on its first run.

It changes which addresses the program gets, never what it computes. It
only takes effect before JAX's backend starts (threads bind to an arena on
their first allocation), is applied only where JAX can run on nothing but
the CPU (no accelerator plugin installed, or JAX_PLATFORMS=cpu), so a GPU or
TPU host's allocator is left as it was, and only under glibc.
`ZERO_JAX_HOST_ALLOCATOR=system` leaves it alone everywhere.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pkgutil

ENV = "ZERO_JAX_HOST_ALLOCATOR"

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_KEEP_ALL = 2**31 - 1  # the largest trim threshold mallopt takes: never trim

_applied = False


def cpu_only(environ=os.environ) -> bool:
    """Whether JAX in this process can only run on the CPU: JAX_PLATFORMS says
    so, or no accelerator plugin (jax_plugins, libtpu) is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return {p.strip() for p in platforms.split(",")} == {"cpu"}
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    if importlib.util.find_spec("libtpu") is not None:
        return False
    spec = importlib.util.find_spec("jax_plugins")
    return spec is None or not any(pkgutil.iter_modules(spec.submodule_search_locations))


def applies(environ=os.environ) -> bool:
    """Whether this process should keep freed memory: CPU only, not opted out."""
    return environ.get(ENV, "") != "system" and cpu_only(environ)


def keep_freed_memory(environ=os.environ) -> bool:
    """Configure glibc's malloc as the module docstring says, once per process,
    where it applies. Returns whether the setting is in effect."""
    global _applied
    if _applied:
        return True
    if not applies(environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its allocator is its own
        return False
    # Order matters: one arena first, so the threads XLA starts share the heap.
    _applied = all(mallopt(param, value) == 1 for param, value in
                   ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEEP_ALL)))
    return _applied
