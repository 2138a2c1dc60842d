"""The all-to-all that carries a device's token copies to their experts'
devices over the expert axis, and their results back.

Each device holds its copies sorted by destination (`sent_P` rows for each
of the P devices of the axis). The exchange packs what a device receives
by source, source 0's rows first, into a buffer sized for the worst case
(every source sending all its rows here); rows past what arrived stay
as the buffer was given. The way back is the same exchange with the roles
swapped, onto the sender's own rows.

Two transports (`EXCHANGES`), one set of offsets (`Routes`):

- `ragged`: `jax.lax.ragged_all_to_all`, each peer sent exactly its rows,
  so the bytes on the wire are the routed copies'. XLA implements it on GPU
  and TPU; XLA:CPU has no ragged-all-to-all.
- `padded`: `jax.lax.all_to_all` of one block per peer sized for the worst
  case (all of a device's rows), then the same packing on arrival: P times
  the routed bytes on the wire when the experts are balanced. Any backend.

`resolve` picks the ragged transport where the backend compiles it;
`node_size` whether an expert axis that spans nodes dispatches in two hops
(models/llama/two_hop.py: a token once to each node it needs, then to the
experts inside it).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

EXCHANGES = ("ragged", "padded")
DISPATCHES = ("direct", "two-hop")
# The name every exchange's result carries: a remat policy that keeps named
# activations keeps it, so the backward pass does not exchange again.
NAME = "moe_exchange"
NATIVE = ("gpu", "tpu")  # platforms whose XLA has ragged-all-to-all (for plans made elsewhere)


class Routes(NamedTuple):
    """One direction's offsets, in `jax.lax.ragged_all_to_all`'s terms."""

    input_offsets: jax.Array  # (P,): where the rows for peer p start here
    send_sizes: jax.Array  # (P,): how many go to p
    output_offsets: jax.Array  # (P,): where they land in p's buffer
    recv_sizes: jax.Array  # (P,): how many arrive here from p


def count(ids, n: int) -> jax.Array:
    """How many of `ids` equal each of 0..n-1 (ids >= n are not counted)."""
    return jnp.zeros((n,), jnp.int32).at[ids].add(1, mode="drop")


def _before(x, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def routes(sent_P: jax.Array, axis: str) -> tuple[Routes, Routes]:
    """The offsets out to the experts and back, from every device's counts
    (an all-gather of P integers each): M[s, d] rows go from s to d; d packs
    them by source, so s's rows start at the sum of M[s', d] over s' < s."""
    M = jax.lax.all_gather(sent_P.astype(jnp.int32), axis)  # (P, P)
    me = jax.lax.axis_index(axis)
    recv = M[:, me]
    out = Routes(_before(sent_P, 0), sent_P, _before(M, 0)[me], recv)
    back = Routes(_before(recv, 0), recv, _before(M, 1)[:, me], sent_P)
    return out, back


def send(rows, buffer, r: Routes, axis: str, transport: str) -> jax.Array:
    """`rows` (grouped by peer as `r` says) into each peer's `buffer`, named NAME."""
    if transport == "ragged":
        got = jax.lax.ragged_all_to_all(rows, buffer, *r, axis_name=axis)
    elif transport == "padded":
        got = _padded(rows, buffer, r, axis)
    else:
        raise ValueError(f"expert exchange {transport!r}: expected one of {', '.join(EXCHANGES)}")
    return checkpoint_name(got, NAME)


def _padded(rows, buffer, r: Routes, axis: str) -> jax.Array:
    """`ragged_all_to_all`'s result through a dense all-to-all: peer p's rows
    in block p, its offset beside it. A block holds as many rows as a peer
    could get: all of this device's, or a whole buffer, whichever is less."""
    P, R = r.send_sizes.shape[0], min(rows.shape[0], buffer.shape[0])
    j = jnp.arange(R)
    picked = jnp.clip(r.input_offsets[:, None] + j, 0, rows.shape[0] - 1)  # (P, R)
    valid = j < r.send_sizes[:, None]
    mask = valid.reshape(valid.shape + (1,) * (rows.ndim - 1))
    blocks = jnp.where(mask, rows[picked], jnp.zeros((), rows.dtype))
    got = jax.lax.all_to_all(blocks, axis, 0, 0)  # block s came from peer s
    at = jax.lax.all_to_all(r.output_offsets, axis, 0, 0)  # where peer s put its rows here
    slot = jnp.where(j < r.recv_sizes[:, None], at[:, None] + j, buffer.shape[0])
    return buffer.at[slot.reshape(-1)].set(got.reshape((P * R,) + rows.shape[1:]), mode="drop")


@functools.cache
def native(platform: str) -> bool:
    """Whether this process's `platform` devices compile ragged-all-to-all
    (a two-row exchange over one device, compiled once per process)."""
    devices = [d for d in jax.devices() if d.platform == platform][:1]
    if not devices:
        return platform in NATIVE
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    spec = jax.sharding.PartitionSpec("x")
    one = jnp.ones((1,), jnp.int32)

    def probe(x):
        return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), 0 * one, one, 0 * one, one,
                                         axis_name="x")

    try:
        jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=spec, out_specs=spec)).lower(
            jax.ShapeDtypeStruct((2,), jnp.float32)).compile()
    except jax.errors.JaxRuntimeError:  # "UNIMPLEMENTED: ragged-all-to-all" (XLA:CPU)
        return False
    return True


def resolve(choice: str, platform: str) -> str:
    """`auto`: ragged where `platform` compiles it, else padded."""
    if choice == "auto":
        return "ragged" if native(platform) else "padded"
    if choice not in EXCHANGES:
        raise ValueError(f"--expert-exchange {choice}: expected auto or one of "
                         f"{', '.join(EXCHANGES)}")
    if choice == "ragged" and not native(platform):
        raise ValueError(f"--expert-exchange ragged on {platform}: its XLA has no "
                         "ragged-all-to-all; use padded (or auto)")
    return choice


def node_size(dispatch: str, per_node: int, nodes: int) -> int:
    """Devices of the expert axis per node for a two-hop dispatch, 0 for one
    hop, from the axis's [ici] (`per_node`) and [dcn] (`nodes`) sizes.
    `auto`: two hops where the axis spans nodes, several devices in each."""
    if dispatch == "auto":
        return per_node if nodes > 1 and per_node > 1 else 0
    if dispatch == "direct":
        return 0
    if dispatch != "two-hop":
        raise ValueError(f"--expert-dispatch {dispatch}: expected auto or one of "
                         f"{', '.join(DISPATCHES)}")
    if nodes == 1:
        raise ValueError(f"--expert-dispatch two-hop: the expert axis ({per_node} devices) is on "
                         "one node; give the mesh an [dcn] expert size above 1, or use direct "
                         "(or auto)")
    return per_node


def resolve_all(exchange: str, dispatch: str, platform: str, per_node: int,
                nodes: int) -> dict[str, object]:
    """The Hooks fields of the experts' exchange: transport and node size."""
    return {"expert_exchange": resolve(exchange, platform),
            "expert_node": node_size(dispatch, per_node, nodes)}
