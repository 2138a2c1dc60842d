"""Optimizer state, master weights and ZeRO-3 parameters in host memory
(ZeRO-Offload, and ZeRO-Infinity's CPU tier).

With `[offload] optimizer = true` the optimizer state lives in `pinned_host`
memory, sharded as the ZeRO stage says; at stages 1 and 2 that includes the
float32 master weights (master.py keeps them in the optimizer state). Each
step the gradients go to the host in the gradient dtype, the update runs
there (`compute_on(compute_type="device_host")`), as ZeRO-Offload runs Adam on
the CPU, and the new stored parameters come back to the device.

Why on the host rather than streamed through the device: streaming brings
the whole optimizer state to the device at the update, which is where a
step's temporaries peak when activations are small (planner/step_bytes.py), so
the device would need the bytes offload is meant to save. Run on the host,
the device never holds the optimizer state or the masters. The cost is per
step, per device: the gradient shard to the host (g bytes per parameter it
stores gradients for) and the new parameter shard back, over the host link,
and the update at the host's speed (docs/offload.md has the measured figures).

With `[offload] params = true` (ZeRO-3 only) the stored parameter shards
live in `pinned_host` too. Each use brings this device's shard of one
layer to the device before it is cast and all-gathered (param_use.py,
`Use.gather`), inside the layer scan, so the device holds a layer's shard
at a time and never the stack; the backward pass keeps the host shard and
fetches it again, as it gathers again. The fetch depends on the loop index only, so with
while-loop double buffering (`wants`) XLA:GPU starts the next
layer's copy while this layer computes. Shards move in their stored dtype
(float32 at ZeRO-3): 4 bytes per parameter this device stores, forward
and backward (and again to recompute under full remat), per microbatch.
New parameters stay in host memory: updated there with the optimizer
offloaded, else fetched whole for the update on the device, beside the
optimizer state, and returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

from zero_jax.runtime import xla_options

HOST = "pinned_host"


def on_host(shardings: Any) -> Any:
    """`shardings` in host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


@dataclasses.dataclass(frozen=True)
class HostUpdate:
    """Runs a step's update on the host, inside the jitted step."""

    params: Any  # where the new stored parameters go (device, or host under params offload)

    def run(self, update: Callable, grads: Any, opt_state: Any, params: Any, finite: jax.Array):
        """`update(grads, opt_state, params, finite) -> (params, opt_state)`
        computed on the host: the new parameters come back to the device, the
        new optimizer state stays in host memory (the step's out_shardings).

        The operands are passed as they are, and XLA moves them: placed in
        host memory explicitly first, JAX types them as host arrays, and
        optax's norms (`x.imag` of a real array) then mix in device-typed
        zeros, which JAX rejects. The compiled step runs the update's
        instructions with the host compute type, on buffers in host memory
        (tests/test_offload.py reads both from its HLO). Its results are
        left in host memory: the optimizer state is stored there, and the
        parameters are then placed where they are stored. Under parameter
        offload the parameters are host arrays already, and stay there."""
        on_cpu = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
        new_params, new_opt = on_cpu(jax.jit(update))(grads, opt_state, params, finite)
        return jax.device_put(new_params, self.params), new_opt


def wants(host_params: bool) -> tuple[xla_options.Want, ...]:
    """What XLA is asked for in a step whose parameters are fetched from host
    memory layer by layer. While-loop double buffering unrolls the layer scan
    in pairs, so that XLA:GPU's scheduler starts the next layer's
    host-to-device copy (it depends on the loop index only, not on the
    layer's output) while this layer computes: the prefetch."""
    return (xla_options.WHILE_LOOP_DOUBLE_BUFFERING,) if host_params else ()
