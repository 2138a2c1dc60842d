"""Optimizer state and master weights in host memory (ZeRO-Offload).

With `[offload] optimizer = true` the optimizer state lives in `pinned_host`
memory, sharded as the ZeRO stage says; at stages 1 and 2 that includes the
float32 master weights (master.py keeps them in the optimizer state). Each
step the gradients go to the host in the gradient dtype, the update runs
there (`compute_on("device_host")`), as ZeRO-Offload runs Adam on the CPU,
and the new stored parameters come back to the device.

Why on the host rather than streamed through the device: streaming brings
the whole optimizer state to the device at the update, which is where a
step's temporaries already peak when activations are small (planner.py), so
the device would need the bytes offload is meant to save. Run on the host,
the device never holds the optimizer state or the masters. The cost is per
step, per device: the gradient shard to the host (g bytes per parameter it
stores gradients for) and the new parameter shard back, over the host link,
and the update at the host's speed (scripts/bench_offload.py measures it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

HOST = "pinned_host"


def on_host(shardings: Any) -> Any:
    """`shardings` in host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


@dataclasses.dataclass(frozen=True)
class HostUpdate:
    """Runs a step's update on the host, inside the jitted step."""

    params: Any  # device shardings of the stored parameters

    def run(self, update: Callable, grads: Any, opt_state: Any, params: Any, finite: jax.Array):
        """`update(grads, opt_state, params, finite) -> (params, opt_state)`
        computed on the host: the new parameters come back to the device, the
        new optimizer state stays in host memory (the step's out_shardings).

        The operands are passed as they are, and XLA moves them: placed in
        host memory explicitly first, JAX types them as host arrays, and
        optax's norms (`x.imag` of a real array) then mix in device-typed
        zeros, which JAX 0.10 rejects. The compiled step runs the update's
        instructions with the host compute type, on buffers in host memory
        (tests/test_offload.py reads both from its HLO)."""
        new_params, new_opt = compute_on("device_host")(jax.jit(update))(
            grads, opt_state, params, finite)
        return jax.device_put(new_params, self.params), new_opt
