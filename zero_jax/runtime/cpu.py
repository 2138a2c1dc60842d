"""Simulated CPU devices: the `--devices N` flag every script shares.

To JAX a CPU is one device unless told otherwise, and the count is fixed
when JAX's backend starts (the first call that asks for devices or runs
anything): the CPU client cannot be remade afterwards. `simulate(n)` sets
`jax_num_cpu_devices` before that. Only the CPU client reads it, so on a
GPU or TPU host the accelerators stay what a mesh is built from.

Which count a process gets, first match wins:

1. under `zero-jax launch`, its `--devices-per-process` (the launcher
   decides each process's share: a process that took another count would
   build a global mesh its peers do not have);
2. `--devices N` (memory_report.py, which only compiles, takes the mesh's
   size when it is not given);
3. `XLA_FLAGS=--xla_force_host_platform_device_count=N`;
4. the script's own default, where it has one (numerics.py: 8); else 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from zero_jax.runtime import host_allocator

# Set by `zero-jax launch` in each process it starts: that process's device count.
ENV_LAUNCHED = "ZERO_JAX_DEVICES_PER_PROCESS"
_XLA_COUNT = "--xla_force_host_platform_device_count="


class DevicesError(ValueError):
    """A device count that cannot be set: below 1, or asked for too late."""


def add_devices_flag(parser: argparse.ArgumentParser,
                     default_help: str = "XLA_FLAGS's, else 1") -> None:
    parser.add_argument(
        "--devices", type=int, metavar="N",
        help=f"simulate N CPU devices (default: {default_help}; under zero-jax launch "
             "its --devices-per-process wins); no effect on GPU or TPU devices")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None,
               default: int | None = None) -> argparse.Namespace:
    """`parser`'s arguments (with `add_devices_flag` among them), then the
    device count they ask for simulated (`simulate`), before anything asks
    JAX for devices. A count that cannot be set ends the program as a user
    error: one line on stderr, exit status 2."""
    args = parser.parse_args(argv)
    try:
        simulate(args.devices, default)
    except DevicesError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return args


def xla_flags_count(environ=os.environ) -> int | None:
    """The count XLA_FLAGS forces, if it names one (the last one given counts)."""
    counts = [f[len(_XLA_COUNT):] for f in environ.get("XLA_FLAGS", "").split()
              if f.startswith(_XLA_COUNT)]
    return int(counts[-1]) if counts else None


def wanted(n: int | None, default: int | None = None, environ=os.environ) -> int | None:
    """The count this process should set itself (None: leave it to the launcher,
    XLA_FLAGS or JAX), by the order in the module docstring."""
    if environ.get(ENV_LAUNCHED):
        return None
    if n is not None:
        return n
    return None if xla_flags_count(environ) is not None else default


def simulate(n: int | None, default: int | None = None) -> int | None:
    """Simulate `n` CPU devices (the --devices flag; None when not given), or
    `default` when neither the launcher nor XLA_FLAGS sets a count. Call it
    before anything asks JAX for devices. Returns the count set, or None.

    Every entry point calls this before JAX's backend starts, which is also
    the only moment the host allocator can be set to reuse a step's freed
    memory (host_allocator.py), so it is done here, device count or not."""
    host_allocator.keep_freed_memory()
    launched = os.environ.get(ENV_LAUNCHED)
    if launched and n is not None and n != int(launched):
        print(f"note: --devices {n} ignored: zero-jax launch gives this process "
              f"{launched} (--devices-per-process)", file=sys.stderr)
    count = wanted(n, default)
    if count is None:
        return None
    if count < 1:
        raise DevicesError(f"--devices {count}: give a device count of at least 1")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX refuses once its backend has started
        have = len(jax.devices("cpu"))
        if have != count:
            raise DevicesError(
                f"--devices {count}: JAX's backend has already started with {have} CPU "
                f"device(s), and the count is fixed then; call zero_jax.runtime.cpu.simulate({count}) "
                "before anything asks JAX for devices, or start Python with "
                f"XLA_FLAGS={_XLA_COUNT}{count}") from None
    return count


def fix_hint(needed: int, environ=os.environ) -> str:
    """How to give this process `needed` devices on a CPU, for error messages."""
    if environ.get(ENV_LAUNCHED):
        return f"under zero-jax launch, make -n times --devices-per-process equal {needed}"
    return f"on a CPU, simulate them with --devices {needed} (or XLA_FLAGS={_XLA_COUNT}{needed})"
