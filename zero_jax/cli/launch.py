"""Start N processes of a JAX program on this machine, as a cluster would.

    zero-jax launch -n 2 --devices-per-process 4 -- zero-jax train --mesh fsdp=8

The program after `--` is a `.py` script (run by this interpreter), `zero-jax`
(this installation's command, run as `python -m zero_jax` by this
interpreter, whether or not it is on PATH), or any program on PATH.
Each process gets the coordinator address (127.0.0.1 and a free port), the
process count and its index (ZERO_JAX_COORDINATOR, ZERO_JAX_NUM_PROCESSES,
ZERO_JAX_PROCESS_ID, read by `zero_jax.runtime.distributed.initialize`) and K
simulated CPU devices. Every line a process prints is prefixed with its
index. The launcher decides the device count: a `--devices` given to the
program is ignored, with a note, where it differs. When one process fails,
the others are killed and the launcher exits with that process's status,
naming it: a dead peer never leaves the rest waiting in a collective.
SIGTERM and SIGINT are passed on to every process (a preemption: they save
at the same step and exit 0).

On a real cluster the scheduler starts the processes instead (see README):
the program is the same.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from zero_jax.runtime import cpu, distributed

COMMAND = "zero-jax"  # as the program: this installation's, `python -m zero_jax`


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> str:
    """Why `port` cannot be the coordinator's ("" when it can): bound on any
    address here, IPv4 or IPv6, as the coordinator binds every address. A
    port only lingering after a closed connection (TIME_WAIT) is free to it."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "already in use on this machine"
            if e.errno in (errno.EACCES, errno.EPERM):
                return f"cannot be bound here ({e.strerror}: ports below 1024 need privileges)"
            if e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                return f"cannot be bound here ({e.strerror})"
    return ""


def process_env(base: dict[str, str], index: int, n: int, port: int, devices: int) -> dict[str, str]:
    flags = [f for f in base.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {**base, distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
            distributed.ENV_NUM_PROCESSES: str(n), distributed.ENV_PROCESS_ID: str(index),
            "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
            cpu.ENV_LAUNCHED: str(devices),  # wins over the program's own --devices
            "JAX_PLATFORMS": base.get("JAX_PLATFORMS", "cpu"), "PYTHONUNBUFFERED": "1"}


def describe_status(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def checked_command(args: argparse.Namespace) -> list[str]:
    """The command each process runs, after checking the launch's arguments:
    a mistake here would otherwise surface N times, once per process."""
    for flag, value in (("-n", args.num_processes),
                        ("--devices-per-process", args.devices_per_process)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if args.pin_cores and args.num_processes > len(os.sched_getaffinity(0)):
        raise ValueError(f"--pin-cores: {args.num_processes} processes, but only "
                         f"{len(os.sched_getaffinity(0))} cores to pin them to")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: a TCP port is 1-65535 (0: a free one)")
    if args.port and (why := port_in_use(args.port)):
        raise ValueError(f"--port {args.port}: {why}; give a free port, or --port 0 (the "
                         "default) for the launcher to pick one")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("no program to run: give it after --, e.g. "
                         "-- zero-jax train --mesh fsdp=8")
    program = command[0]
    if program == COMMAND:
        return [sys.executable, "-m", "zero_jax", *command[1:]]
    if program.endswith(".py"):
        if not Path(program).is_file():
            raise ValueError(f"-- {program}: no such script (relative to {Path.cwd()})")
        return [sys.executable, *command]
    if shutil.which(program) is None:
        raise ValueError(f"-- {program}: no such program on PATH, and not a .py script")
    return command


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True,
                        help="processes to start on this machine (jax.distributed's process count)")
    parser.add_argument("--devices-per-process", type=int, default=1,
                        help="simulated CPU devices per process (wins over the program's --devices)")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument("--pin-cores", action="store_true",
                        help="pin process i to the i-th CPU core this launcher may use, so that "
                             "a process waiting in a collective cannot lend its core to another")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args]")
    return parser.parse_args(argv)


class Output:
    """Every process's lines on this stdout, each prefixed with its index,
    one whole line at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def follow(self, index: int, stream) -> None:
        thread = threading.Thread(target=self._pump, args=(index, stream), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _pump(self, index: int, stream) -> None:
        for line in stream:
            with self.lock:
                sys.stdout.write(f"[{index}] {line}")
                sys.stdout.flush()

    def drain(self) -> None:
        """Every line out (before the verdict)."""
        for thread in self.threads:
            thread.join(timeout=5)

    def say(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)


def start(command: list[str], args: argparse.Namespace, output: Output) -> list[subprocess.Popen]:
    """The N processes, each in a session of its own (killed as a group)."""
    port, n = args.port or free_port(), args.num_processes
    cores = sorted(os.sched_getaffinity(0)) if args.pin_cores else []
    procs = []
    for i in range(n):
        pin = None
        if cores:
            def pin(core=cores[i % len(cores)]):
                os.sched_setaffinity(0, {core})
        p = subprocess.Popen(command, env=process_env(dict(os.environ), i, n, port,
                                                       args.devices_per_process),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, preexec_fn=pin)
        output.follow(i, p.stdout)
        procs.append(p)
    return procs


def forward(procs: list[subprocess.Popen], signum, frame) -> None:
    """A signal to the launcher, passed on to every process still running."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)


def first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """(index, status) of the first process to fail, once one has or all
    have ended; None when every one exited 0."""
    while True:
        codes = [p.poll() for p in procs]  # every one, each round
        if all(c is not None for c in codes):
            break
        bad = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
        if bad:
            return bad[0]
        time.sleep(0.1)
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    return bad[0] if bad else None


def stop(procs: list[subprocess.Popen], failed: tuple[int, int], output: Output) -> int:
    """Kill the survivors of a failure, name the process that failed; its status."""
    index, code = failed
    alive = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in alive:
        os.killpg(procs[i].pid, signal.SIGKILL)  # stuck in a collective: nothing else ends it
    for p in procs:
        p.wait()
    output.drain()
    output.say(f"launch: process {index} failed ({describe_status(code)})"
               + (f"; killed processes {alive}" if alive else ""))
    return code if code > 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        command = checked_command(args)
    except ValueError as e:  # before any process starts
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = Output()
    procs = start(command, args, output)
    signal.signal(signal.SIGTERM, functools.partial(forward, procs))
    signal.signal(signal.SIGINT, functools.partial(forward, procs))
    failed = first_failure(procs)
    if failed is not None:
        return stop(procs, failed, output)
    output.drain()
    return 0
