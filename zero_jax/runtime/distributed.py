"""Several processes on JAX's own runtime: start-up, barriers, agreement.

`initialize` sets up `jax.distributed` from explicit settings (flags, or the
ZERO_JAX_* variables `zero-jax launch` gives each process), else from a
cluster JAX detects (SLURM, Open MPI, Kubernetes, Cloud TPU), and does
nothing for a single process. Every wait on other processes here has a
timeout: a barrier that waits forever is how one dead rank holds a whole
cluster for hours.

`agree` makes processes compare what they are about to run (a fingerprint
of the compiled train step and the run config) through the coordinator's
key-value store, not a collective: processes that traced different
programs would hang in a collective, while the store answers or times out.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np

from zero_jax.config.sections import DistributedConfig

ENV_COORDINATOR = "ZERO_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "ZERO_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZERO_JAX_PROCESS_ID"

# Markers of multi-process launchers JAX can read its settings from.
_CLUSTERS = {
    "SLURM": lambda e: int(e.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in e,
    "Open MPI": lambda e: int(e.get("OMPI_COMM_WORLD_SIZE", "1")) > 1,
    "Kubernetes (JobSet)": lambda e: "KUBERNETES_SERVICE_HOST" in e and "JOB_COMPLETION_INDEX" in e,
    "Cloud TPU pod": lambda e: "," in e.get("TPU_WORKER_HOSTNAMES", ""),
}




class DistributedError(RuntimeError):
    """Processes that cannot start together, or do not agree, or stopped answering."""


def settings(cfg: DistributedConfig, environ=os.environ) -> dict[str, Any] | None:
    """Arguments for `jax.distributed.initialize`, or None for one process."""
    coordinator = cfg.coordinator or environ.get(ENV_COORDINATOR, "")
    timeouts = {"initialization_timeout": cfg.barrier_timeout_s,
                "heartbeat_timeout_seconds": cfg.heartbeat_timeout_s}
    if coordinator:
        n = cfg.num_processes or int(environ.get(ENV_NUM_PROCESSES, "0"))
        i = cfg.process_id if cfg.process_id >= 0 else int(environ.get(ENV_PROCESS_ID, "-1"))
        if n < 1 or not 0 <= i < n:
            raise DistributedError(
                f"coordinator {coordinator} given with num_processes={n}, process_id={i}; "
                "give --num-processes N and --process-id 0..N-1 (or run under zero-jax launch)")
        if n == 1:
            return None
        return {"coordinator_address": coordinator, "num_processes": n, "process_id": i, **timeouts}
    if any(present(environ) for present in _CLUSTERS.values()):
        return timeouts  # JAX reads coordinator, count and id from the cluster
    return None


def initialize(cfg: DistributedConfig) -> bool:
    """Start `jax.distributed` if this run has several processes; True if it did."""
    args = settings(cfg)
    if args is None or jax.distributed.is_initialized():
        return False
    jax.distributed.initialize(**args)
    if not shares_compilation_cache(jax.default_backend()) and _compilation_cache_on():
        jax.config.update("jax_enable_compilation_cache", False)
        if jax.process_index() == 0:
            print(f"the persistent compilation cache is off: on the {jax.default_backend()} "
                  f"backend JAX keys it per process (docs/hosts.md#the-compilation-cache)")
    return True


def shares_compilation_cache(backend: str) -> bool:
    """Whether the processes of a run on `backend` find the same entries in
    JAX's persistent compilation cache.

    JAX keys an entry by the program, the compile options and the devices'
    topology fingerprint, and only process 0 writes. On GPUs JAX means the
    key to agree across processes (it leaves the device assignment out
    there, and can share compiled binaries between hosts; not measured
    here). On the CPU backend the topology fingerprint differs from one
    process to the next (jax 0.10.2, 0.11.2 and 0.12.1), so with a warm cache
    process 0 runs the program it loads while every other process runs the
    one it compiles. The two need not schedule their collectives alike:
    under jax 0.12.1 a 2-process resume deadlocked in its checkpoint
    checksums in each of 3 tries with a warm cache; cold, it never did."""
    return backend != "cpu"


def _compilation_cache_on() -> bool:
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


def _client():
    from jax._src import distributed  # the coordination client has no public handle

    return distributed.global_state.client


def barrier(name: str, timeout_s: float) -> None:
    """Wait for every process at `name`, or fail after `timeout_s` naming it."""
    if jax.process_count() == 1:
        return
    try:
        _client().wait_at_barrier(f"zero_jax/{name}", int(timeout_s * 1000))
    except Exception as e:  # the client raises XlaRuntimeError subclasses
        raise DistributedError(
            f"barrier {name!r}: not every process arrived within {timeout_s:g} s "
            f"(process {jax.process_index()} of {jax.process_count()} waited): {e}") from None


def agree(name: str, value: dict[str, Any], timeout_s: float) -> None:
    """Every process publishes `value`; all must be equal, else an error that
    names the differing processes and the keys they differ in."""
    if jax.process_count() == 1:
        return
    client, me, n = _client(), jax.process_index(), jax.process_count()
    text = json.dumps(value, sort_keys=True, default=str)
    client.key_value_set(f"zero_jax/{name}/{me}", text)
    try:
        seen = [json.loads(client.blocking_key_value_get(f"zero_jax/{name}/{i}", int(timeout_s * 1000)))
                for i in range(n)]
    except Exception as e:
        raise DistributedError(
            f"{name}: not every process published within {timeout_s:g} s (process {me} "
            f"waited): {e}") from None
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(seen):
        groups.setdefault(json.dumps(v, sort_keys=True), []).append(i)
    if len(groups) == 1:
        return
    lines = [f"{name} differs between processes; they would hang in the first collective "
             f"(process 0 with processes {groups[json.dumps(seen[0], sort_keys=True)]}):"]
    first = seen[0]
    for members in groups.values():
        if 0 in members:
            continue
        v = seen[members[0]]
        keys = sorted(k for k in set(first) | set(v) if first.get(k) != v.get(k))
        what = ", ".join(f"{k}={_short(v.get(k))} (process 0: {_short(first.get(k))})" for k in keys)
        lines.append(f"  processes {members}: " + (what or "as process 0"))
    raise DistributedError("\n".join(lines))


def _short(v: Any) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def local(tree: Any) -> Any:
    """Replicated arrays as numpy, each process reading its own copy
    (`device_get` refuses arrays that span processes)."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)


def fingerprint(compiled_text: str) -> str:
    return hashlib.sha256(compiled_text.encode()).hexdigest()[:16]
