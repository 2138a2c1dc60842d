"""Start N processes of a JAX program on this machine, as a cluster would.

    python scripts/launch.py -n 2 --devices-per-process 4 -- scripts/train.py --mesh fsdp=8

Each process gets the coordinator address (127.0.0.1 and a free port), the
process count and its index (ZERO_JAX_COORDINATOR, ZERO_JAX_NUM_PROCESSES,
ZERO_JAX_PROCESS_ID, read by `zero_jax.distributed.initialize`) and K
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
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zero_jax.runtime import cpu  # noqa: E402
from zero_jax.runtime import distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: a TCP port is 1-65535 (0: a free one)")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("no program to run: give it after --, e.g. "
                         "-- scripts/train.py --mesh fsdp=8")
    program = command[0]
    if program.endswith(".py"):
        if not Path(program).is_file():
            raise ValueError(f"-- {program}: no such script (relative to {Path.cwd()})")
        return [sys.executable, *command]
    if shutil.which(program) is None:
        raise ValueError(f"-- {program}: no such program on PATH, and not a .py script")
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1,
                        help="simulated CPU devices per process (wins over the program's --devices)")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args]")
    args = parser.parse_args(argv)
    try:
        command = checked_command(args)
    except ValueError as e:  # before any process starts
        print(f"error: {e}", file=sys.stderr)
        return 2
    port = args.port or free_port()
    n = args.num_processes

    lock = threading.Lock()

    def pump(index: int, stream) -> None:
        for line in stream:
            with lock:
                sys.stdout.write(f"[{index}] {line}")
                sys.stdout.flush()

    procs, pumps = [], []
    for i in range(n):
        p = subprocess.Popen(command, env=process_env(dict(os.environ), i, n, port,
                                                       args.devices_per_process),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        pumps.append(threading.Thread(target=pump, args=(i, p.stdout), daemon=True))
        pumps[-1].start()
        procs.append(p)

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    failed = None
    while True:
        codes = [p.poll() for p in procs]  # every one, each round
        if all(c is not None for c in codes):
            break
        bad = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
        if bad:
            failed = bad[0]
            break
        time.sleep(0.1)
    if failed is None:
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        failed = bad[0] if bad else None
    if failed is not None:
        index, code = failed
        alive = [i for i, p in enumerate(procs) if p.poll() is None]
        for i in alive:
            os.killpg(procs[i].pid, signal.SIGKILL)  # stuck in a collective: nothing else ends it
        for p in procs:
            p.wait()
        for t in pumps:  # every line out before the verdict
            t.join(timeout=5)
        with lock:
            print(f"launch: process {index} failed ({describe_status(code)})"
                  + (f"; killed processes {alive}" if alive else ""), flush=True)
        return code if code > 0 else 128 - code
    for t in pumps:
        t.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
