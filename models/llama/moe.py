"""A mixture-of-experts MLP for the Llama family (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router (a linear map, no bias) scores every expert for each token; each
token goes to its top-k (token choice), weighted by the softmax of the
scores, renormalised over the k where the model says so (Mixtral, Qwen3).
DeepSeek-V3 scores by sigmoid instead, chooses with a per-expert bias
(aux-loss-free balancing, zero_jax/model/balance.py) from the token's best
groups of experts only, and scales the renormalised weights (`route`).
Each expert is a SwiGLU MLP; the experts' matrices are stored stacked,
`(experts, embed, mlp)`. Shared experts (DeepSeek, Qwen2-MoE: always on,
Qwen2-MoE's scaled by a per-token sigmoid) are a dense SwiGLU beside them.

Dropless (the default): a device's token copies are sorted by expert and
multiplied with grouped GEMMs (zero_jax/model/grouped.py: tiled, or
`jax.lax.ragged_dot`), so no token is dropped and no padding is computed.
With a capacity factor c, expert e takes at most C = ceil(c k N / E) of a
device's N tokens' copies, first choices first and then by position
(GShard, Switch, DeepSpeed-MoE); the copies past it are dropped (the token
keeps its residual) and each expert multiplies a fixed (C, D) block.

Expert parallelism: the `experts` dimension is split over the mesh axis
that the `experts` rule names (`expert`). The dispatch runs per device
(`Hooks.local`, a shard_map over every axis that splits the tokens or an
expert): the router's choices are local, the copies travel to their
experts' devices with one all-to-all and come back with another. Dropless,
each device sends every peer a block sized for the worst case (all of its
copies) because XLA:CPU has no `ragged-all-to-all`; the padding rows are
sent but never multiplied. An expert's `mlp` split over `tensor` is
Megatron's column/row split, the output summed over `tensor`.

Names: N tokens on this device, k choices per token, A = N k copies, E
experts (El on this device, ep devices over the expert axis), D model
width, F expert width, C capacity.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.common import layers
from models.llama import two_hop
from zero_jax.model import balance
from zero_jax.model import exchange
from zero_jax.model import fp8 as fp8_lib
from zero_jax.model import grouped
from zero_jax.model.hooks import Hooks


class Routing(NamedTuple):
    """The router's choice for each token."""

    weights_Nxk: jax.Array  # float32 weight of each chosen expert
    experts_Nxk: jax.Array  # int32 expert ids, best first
    probs_NxE: jax.Array  # float32 softmax over all experts
    logz_N: jax.Array  # float32 log-sum-exp of the router's scores (for the z-loss)


def route(logits_NxE: jax.Array, k: int, normalise: bool, sigmoid: bool = False,
          bias_E: jax.Array | None = None, groups: tuple[int, int] = (1, 1),
          scale: float = 1.0) -> Routing:
    """Scores over the experts (softmax, or DeepSeek-V3's per-expert
    sigmoid), then the top k, their weights renormalised to sum to one when
    `normalise` (Mixtral, Qwen3-MoE, DeepSeek-V3) and times `scale`
    (DeepSeek-V3's routed_scaling_factor).

    `bias_E` (aux-loss-free balancing) is added to the scores to choose
    the k and to nothing else. `groups` = (n_group, topk_group): the
    experts in n_group equal groups, each scored by its two best experts'
    sum, and a token's k chosen from its topk_group best groups only
    (DeepSeek-V3's group-limited routing)."""
    logits = logits_NxE.astype(jnp.float32)
    N, E = logits.shape
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias_E is None else scores + jax.lax.stop_gradient(bias_E)
    n_group, topk_group = groups
    if n_group > 1:
        grouped = choice.reshape(N, n_group, E // n_group)
        best = jnp.sum(jax.lax.top_k(grouped, min(2, E // n_group))[0], axis=-1)
        chosen = jax.nn.one_hot(jax.lax.top_k(best, topk_group)[1], n_group).sum(1) > 0
        allowed = jnp.repeat(chosen, E // n_group, axis=1)
        choice = jnp.where(allowed, choice, -jnp.inf)
    experts = jax.lax.top_k(choice, k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalise:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if sigmoid else 0))
    # The balance loss's probabilities: sigmoid scores normalised per token (DeepSeek-V3).
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True) if sigmoid else scores
    return Routing(weights * scale, experts.astype(jnp.int32), probs,
                   jax.nn.logsumexp(logits, axis=-1))


def row_stats(routing: Routing, n_experts: int, rows: int) -> dict[str, jax.Array]:
    """Per sequence (row) of `rows`: the load-balancing loss of Switch and
    Mixtral, E sum_e f_e P_e (f_e the row's copies routed to expert e per
    token, which sum to k over the experts; P_e its mean router
    probability: k when balanced), the router z-loss (the mean squared
    log-sum-exp of the scores), and the copies routed to each expert.

    Computed per sequence, so a batch's value is the weighted sum of its
    rows' whatever the layout splits (DeepSeek-V3's sequence-wise balance
    loss; Hugging Face's Mixtral pools the whole batch instead)."""
    E, k = n_experts, routing.experts_Nxk.shape[-1]
    chosen = jax.nn.one_hot(routing.experts_Nxk, E, dtype=jnp.float32).sum(1)  # N x E
    chosen_BxSxE = chosen.reshape(rows, -1, E)
    f_BxE = chosen_BxSxE.mean(1)
    p_BxE = routing.probs_NxE.reshape(rows, -1, E).mean(1)
    return {"aux_loss": E * jnp.sum(f_BxE * p_BxE, axis=-1),
            "z_loss": jnp.mean(jnp.square(routing.logz_N.reshape(rows, -1)), axis=1),
            "expert_load": chosen_BxSxE.sum(1) / k}


def _swiglu(x, w_gate, w_up, w_down, product, fp8: bool = False):
    """SwiGLU through `product(x, w)` (one matrix per expert), its
    activations named as the dense MLP names them (for remat policies);
    with `fp8` each product in FP8 (zero_jax.model.fp8.product)."""
    if fp8:
        product = fp8_lib.product(product)
    gate = checkpoint_name(product(x, w_gate), "mlp_hidden")
    up = checkpoint_name(product(x, w_up), "mlp_hidden")
    hidden = checkpoint_name(jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype) * up,
                             "mlp_act")
    return product(hidden, w_down)


def _grouped(rows_AxD, counts_E, w_gate, w_up, w_down, kernels: "Kernels", expected_rows: int,
             fp8: bool = False):
    """SwiGLU of rows sorted by expert, `counts_E` rows each: grouped GEMMs
    (zero_jax/model/grouped.py, tiles sized for `expected_rows`). Rows past
    the counts' sum come out zero."""
    product = grouped.product(kernels.gemm, counts_E, expected_rows)
    return _swiglu(rows_AxD, w_gate, w_up, w_down, product, fp8)


class Kernels(NamedTuple):
    """How the dropless path multiplies and moves copies (resolved choices)."""

    gemm: str = "tiled"  # grouped.GEMMS
    exchange: str = "padded"  # exchange.EXCHANGES
    node: int = 0  # devices of the expert axis per node where it spans nodes (two hops); 0: one hop


def _exchange(x, axis: str | None):
    """Block s of a (ep, ...) array to device s of `axis`; the result's block
    s came from device s. Named like every exchange (exchange.NAME)."""
    if axis is None:
        return x
    return checkpoint_name(jax.lax.all_to_all(x, axis, 0, 0), exchange.NAME)


def dropless(x_NxD, routing: Routing, w_gate, w_up, w_down, n_experts: int,
             axis: str | None, ep: int, kernels: Kernels = Kernels(), fp8: bool = False):
    """Every copy multiplied by its expert; (N, D), weighted and summed over k.
    The expert weights are this device's El = E / ep experts; `fp8`: the
    grouped GEMMs in FP8.

    Over an expert axis, the copies (sorted by expert, so by device) go to
    their experts' devices (exchange.py), arriving packed by source into a
    buffer of ep A rows (the worst case) whose unfilled rows carry expert id
    El: sorted last, not counted, multiplied by nothing. Where the axis
    spans nodes (`kernels.node`), in two hops (two_hop.py)."""
    N, D = x_NxD.shape
    k = routing.experts_Nxk.shape[1]
    A, El = N * k, n_experts // ep

    def local(rows_RxD, ids_R):
        """This device's experts on rows in any order, expert id El: none."""
        by_expert = jnp.argsort(ids_R, stable=True)
        done = _grouped(rows_RxD[by_expert], exchange.count(ids_R, El), w_gate, w_up, w_down,
                        kernels, A, fp8)
        return jnp.zeros_like(done).at[by_expert].set(done)

    if 0 < kernels.node < ep:
        return two_hop.dispatch(x_NxD, routing.weights_Nxk, routing.experts_Nxk, local,
                                n_experts, axis, ep, kernels.node, kernels.exchange)
    flat = routing.experts_Nxk.reshape(A)  # copy a is token a // k's choice a % k
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    rows = x_NxD[order // k]
    if ep == 1:
        out = _grouped(rows, exchange.count(sorted_e, El), w_gate, w_up, w_down, kernels, A, fp8)
    else:
        dest = sorted_e // El
        there, back = exchange.routes(exchange.count(dest, ep), axis)
        got = exchange.send(rows, jnp.zeros((ep * A, D), rows.dtype), there, axis,
                            kernels.exchange)
        got_e = exchange.send(sorted_e - dest * El, jnp.full((ep * A,), El, jnp.int32), there,
                              axis, kernels.exchange)
        out = exchange.send(local(got, got_e), jnp.zeros_like(rows), back, axis,
                            kernels.exchange)
    copies = jnp.zeros_like(out).at[order].set(out).reshape(N, k, D)
    return jnp.einsum("nkd,nk->nd", copies, routing.weights_Nxk.astype(copies.dtype))


def capacity(tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Copies each expert takes from one device's `tokens` tokens."""
    return max(1, math.ceil(factor * tokens * k / n_experts))


def capped(x_NxD, routing: Routing, w_gate, w_up, w_down, n_experts: int,
           axis: str | None, ep: int, factor: float, fp8: bool = False):
    """At most C copies per expert from this device, first choices first;
    the copies past C contribute nothing. (N, D). `fp8`: the expert GEMMs
    in FP8."""
    N, D = x_NxD.shape
    k = routing.experts_Nxk.shape[1]
    E, El, C = n_experts, n_experts // ep, capacity(N, k, n_experts, factor)
    # Priority: choice j of every token before choice j + 1 of any, then position.
    flat = routing.experts_Nxk.T.reshape(N * k)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    count = exchange.count(sorted_e, E)
    pos = jnp.arange(N * k) - (jnp.cumsum(count) - count)[sorted_e]
    token = order % N
    slots = jnp.zeros((E, C, D), x_NxD.dtype).at[sorted_e, pos].set(x_NxD[token], mode="drop")
    # Expert e's block goes to device e // El; each device stacks its experts'
    # blocks from every source device.
    got = _exchange(slots.reshape(ep, El, C, D), axis)
    got = got.transpose(1, 0, 2, 3).reshape(El, ep * C, D)
    done = _swiglu(got, w_gate, w_up, w_down, lambda x, w: jnp.einsum("ecd,edf->ecf", x, w), fp8)
    back = _exchange(done.reshape(El, ep, C, D).transpose(1, 0, 2, 3), axis).reshape(E, C, D)
    kept = (pos < C)[:, None]
    out = jnp.where(kept, back[sorted_e, jnp.minimum(pos, C - 1)], 0)
    weight = routing.weights_Nxk.T.reshape(N * k)[order]
    return jnp.zeros((N, D), out.dtype).at[token].add(out * weight[:, None].astype(out.dtype))


def kernels(h: Hooks) -> Kernels:
    """The dropless path's grouped GEMM and exchange as the hooks name them
    (a job resolves them for its platform); `auto` left, for this backend."""
    concrete = isinstance(h.mesh, jax.sharding.Mesh)  # a pipeline's stage sees an abstract one
    platform = h.mesh.devices.flat[0].platform if concrete else jax.default_backend()
    moves = h.expert_exchange
    return Kernels(grouped.resolve(h.expert_gemm),
                   exchange.resolve(moves, platform) if moves == "auto" else moves,
                   node=h.expert_node)


class MoEMLP(nn.Module):
    """The block's MLP as a mixture of experts, with optional shared experts
    (always on, beside the routed ones: DeepSeek, Qwen2-MoE). Returns the
    output and the per-row router statistics (`row_stats`)."""

    cfg: Any  # LlamaConfig with n_experts > 0
    hooks: Hooks

    @nn.compact
    def __call__(self, y_BxTxD):
        c, h = self.cfg, self.hooks
        B, T, D = y_BxTxD.shape
        E, F, k = c.n_experts, c.expert_mlp, c.n_experts_per_tok
        normal = nn.initializers.normal(0.02)
        residual = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))

        def param(name, shape, names, init=normal):
            return layers.param(self, name, shape, names, init)

        # The router sees every expert on every device: its output axis is unsplit.
        logits = h.dense("btd,de->bte", y_BxTxD, param("w_router", (D, E), ("embed", None)),
                         ("embed", None))
        bias = None
        if c.expert_bias:  # aux-loss-free balancing (zero_jax/model/balance.py)
            bias = h.weight(param(balance.NAME, (E,), (None,), nn.initializers.zeros), (None,),
                            jnp.float32)
        routing = route(logits.reshape(B * T, E), k, c.norm_topk_prob,
                        sigmoid=c.score_func == "sigmoid", bias_E=bias,
                        groups=(c.n_group, c.topk_group), scale=c.routed_scaling_factor)
        stats = row_stats(routing, E, B)
        if c.score_func == "sigmoid":  # DeepSeek-V3's sequence-wise loss: E / k sum_e f_e P_e
            stats["aux_loss"] = stats["aux_loss"] / k
        stacked = ("experts", "embed", "mlp")
        w_gate = h.weight(param("w_experts_gate", (E, D, F), stacked), stacked)
        w_up = h.weight(param("w_experts_up", (E, D, F), stacked), stacked)
        down = ("experts", "mlp", "embed")
        w_down = h.weight(param("w_experts_down", (E, F, D), down, residual), down)
        axis, tensor = h.axis_of("experts"), h.axis_of("mlp")

        def dispatch(x_BxTxD, weights_BxTxk, experts_BxTxk, w_gate, w_up, w_down):
            b, t, _ = x_BxTxD.shape
            local = Routing(weights_BxTxk.reshape(b * t, k), experts_BxTxk.reshape(b * t, k),
                            None, None)
            ep = E // w_gate.shape[0]
            x = x_BxTxD.reshape(b * t, D)
            if c.capacity_factor:
                out = capped(x, local, w_gate, w_up, w_down, E, axis, ep, c.capacity_factor,
                             fp8=bool(h.fp8))
            else:
                out = dropless(x, local, w_gate, w_up, w_down, E, axis, ep, kernels(h),
                               fp8=bool(h.fp8))
            if tensor is not None:  # row-parallel down projection: partial sums
                out = jax.lax.psum(out.astype(jnp.float32), tensor).astype(out.dtype)
            return out.reshape(b, t, D)

        tokens = ("batch", "seq", "embed")
        choice = ("batch", "seq", None)
        out = h.local(dispatch, (tokens, choice, choice, stacked, stacked, down), tokens)(
            y_BxTxD, routing.weights_Nxk.reshape(B, T, k), routing.experts_Nxk.reshape(B, T, k),
            w_gate, w_up, w_down)
        out = h.act(out, tokens)
        if bias is not None:  # the loads, reported as the bias's gradient
            out = balance.reported(out, bias, exchange.count(routing.experts_Nxk.reshape(-1), E)
                                   .astype(jnp.float32))
        if c.n_shared_experts:
            out = out + self.shared(y_BxTxD, param, residual)
        return out, stats

    def shared(self, y_BxTxD, param, residual):
        """The shared experts: a SwiGLU every token passes through, in FP8
        where the policy says so (they are dense projections)."""
        c, h = self.cfg, self.hooks
        D, S = y_BxTxD.shape[-1], c.shared_mlp

        def project(eq, x, name, shape, names, init=nn.initializers.normal(0.02)):
            return layers.projection(self, h, eq, x, name, shape, names, init)

        gate = project("btd,df->btf", y_BxTxD, "w_shared_gate", (D, S), ("embed", "mlp"))
        up = project("btd,df->btf", y_BxTxD, "w_shared_up", (D, S), ("embed", "mlp"))
        hidden = jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype) * up
        shared = project("btf,fd->btd", hidden, "w_shared_down", (S, D), ("mlp", "embed"), residual)
        if c.shared_expert_gate:  # Qwen2-MoE: a per-token sigmoid scales them
            mix = h.dense("btd,do->bto", y_BxTxD, param("w_shared_mix", (D, 1), ("embed", None)),
                          ("embed", None))
            shared = (jax.nn.sigmoid(mix.astype(jnp.float32)) * shared).astype(shared.dtype)
        return shared


def penalty(stats: dict[str, jax.Array], row_weights_B: jax.Array, aux_coef: float,
            z_coef: float, layers: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The router losses of a batch (or part of one) from the stacked layers'
    `row_stats` (L, B, ...): each the mean over layers of the rows' values
    weighted by their share of the batch's targets (summing over the parts
    of a batch gives the batch's), and the term they add to the training
    loss; with the copies routed to each expert per layer (L, E).

    With `layers`, the stats are those of some of the model's `layers`
    (a pipeline stage's): the sum over them divided by `layers`, so that
    the stages' values add up to the model's mean (rows of zeros, a padding
    slot's, add nothing)."""
    def weighted(x_LxB):
        total = jnp.sum(x_LxB * row_weights_B)
        return total / (x_LxB.shape[0] if layers is None else layers)

    aux, z = weighted(stats["aux_loss"]), weighted(stats["z_loss"])
    return aux_coef * aux + z_coef * z, {"aux_loss": aux, "z_loss": z,
                                         "expert_load": stats["expert_load"].sum(1)}

