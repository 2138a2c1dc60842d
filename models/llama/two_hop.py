"""Dropless expert dispatch in two hops, for an expert axis that spans nodes
(DeepSeek-V3's: each token crosses the inter-node link once per node it
needs, then fans out to that node's experts over the node's own link).

Hop one sends each token once to every node holding one of its experts,
to the device of the same slot there (peers in other slots get nothing),
with its expert ids and weights for that node. Hop two, inside the node,
sends a copy to each expert's device. The results come back the same way,
each node's copies summed with their weights at the first hop's receiver,
so one row per (token, node) crosses the inter-node link each way. With
group-limited routing a token needs at most topk_group nodes (where the
groups are whole nodes' experts), the bound DeepSeek-V3 designs for.

Both hops are `exchange.send`s over the one `expert` axis with zero rows
to the peers a hop does not use: ragged, the wire carries only the rows
sent. Names as in moe.py; ep devices on the axis, p per node, m = ep / p
nodes, El experts per device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zero_jax.model import exchange


def dispatch(x_NxD, weights_Nxk, experts_Nxk, experts_fn, n_experts: int, axis: str,
             ep: int, node: int, transport: str):
    """Each token through its experts over `axis` (ep devices, `node` per
    node): (N, D), weighted and summed over k. `experts_fn(rows, ids)` runs
    this device's experts (El of them) on rows whose local expert ids are
    `ids` (El: padding, multiplied by nothing)."""
    N, D = x_NxD.shape
    k = experts_Nxk.shape[1]
    El, p, m = n_experts // ep, node, ep // node
    me = jax.lax.axis_index(axis)
    node_Nxk = experts_Nxk // El // p
    needs_NxM = jnp.any(node_Nxk[:, :, None] == jnp.arange(m), axis=1)
    # Hop one: (token, node) pairs, node-major, the needed ones first.
    B1 = N * min(k, m)
    pick = jnp.argsort(~needs_NxM.T.reshape(m * N), stable=True)[:B1]
    token, to_node = pick % N, pick // N
    valid = jnp.arange(B1) < jnp.sum(needs_NxM)
    here = (node_Nxk[token] == to_node[:, None]) & valid[:, None]  # the pair's copies
    rows = jnp.where(valid[:, None], x_NxD[token], 0)
    ids = jnp.where(here, experts_Nxk[token], -1)
    weights = jnp.where(here, weights_Nxk[token], 0)
    per_node = jnp.zeros((m,), jnp.int32).at[to_node].add(valid.astype(jnp.int32))
    sent = jnp.where(jnp.arange(ep) % p == me % p, per_node[jnp.arange(ep) // p], 0)
    there, back = exchange.routes(sent, axis)
    R1 = m * N  # from each node's device of this slot, each token at most once
    got = exchange.send(rows, jnp.zeros((R1, D), rows.dtype), there, axis, transport)
    got_ids = exchange.send(ids, jnp.full((R1, k), -1, jnp.int32), there, axis, transport)
    got_w = exchange.send(weights, jnp.zeros((R1, k), weights.dtype), there, axis, transport)
    # Hop two: inside the node, a copy to each expert's device.
    flat = got_ids.reshape(R1 * k)
    key = jnp.where(flat >= 0, flat, n_experts)  # nothing to send: sorted last
    order = jnp.argsort(key, stable=True)
    sorted_e = key[order]
    dest = sorted_e // El  # ep for nothing: not counted
    out2, back2 = exchange.routes(exchange.count(dest, ep), axis)
    R2 = ep * N * k  # the worst case: every copy of the node's tokens here
    got2 = exchange.send(got[order // k], jnp.zeros((R2, D), got.dtype), out2, axis, transport)
    local = jnp.where(sorted_e < n_experts, sorted_e - dest * El, El)
    got2_e = exchange.send(local, jnp.full((R2,), El, jnp.int32), out2, axis, transport)
    done = experts_fn(got2, got2_e)
    copies = exchange.send(done, jnp.zeros((R1 * k, D), done.dtype), back2, axis, transport)
    copies = jnp.zeros_like(copies).at[order].set(copies).reshape(R1, k, D)
    # Each node's copies of a token summed at the first hop's receiver, one row back.
    partial = jnp.einsum("rkd,rk->rd", copies, got_w.astype(copies.dtype))
    returned = exchange.send(partial, jnp.zeros_like(rows), back, axis, transport)
    return jnp.zeros((N, D), returned.dtype).at[token].add(
        jnp.where(valid[:, None], returned, 0))
