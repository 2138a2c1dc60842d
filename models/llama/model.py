"""The decoder behind Llama 2 and 3, Mistral, Qwen2, and the mixtures of
experts Mixtral, Qwen3-MoE, DeepSeek-V3 and Kimi-K2, in Flax: RMSNorm,
rotary embeddings (Hugging Face's half-rotation layout), SwiGLU MLP or a
mixture of SwiGLU experts (models/llama/moe.py), grouped-query attention or
DeepSeek's latent attention (models/llama/mla.py), an untied head (tied as
an option), q/k/v biases for Qwen2, q/k norms for Qwen3, and no other
biases; the blocks are one scanned, stacked layer (a mixture's dense first
layers a stack of their own), followed by DeepSeek-V3's multi-token
prediction modules where the shape has them. The shape is config.py's.

The model names logical axes only; `Hooks` (zero_jax.model.hooks) turn them into
sharding constraints, exactly as for the GPT (models/gpt/model.py), so every ZeRO
stage, tensor and sequence parallelism, pipelines and remat apply unchanged.
Key/value heads have their own logical axis, `kv_heads`: split over `tensor`
where it divides them, else replicated within the tensor group (job.py).
Tensor names carry their shapes: B batch, T sequence, D model width, H query
heads, K key/value heads, Q head size, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import block, decoder, layers
from models.llama import mla, moe
from models.llama.config import LlamaConfig, config  # noqa: F401  (the family's shape, by preset)
from zero_jax.model import loss as loss_lib
from zero_jax.model.hooks import Hooks
from zero_jax.model.contract import ModelFns


class RMSNorm(nn.Module):
    cfg: LlamaConfig
    hooks: Hooks

    @nn.compact
    def __call__(self, x_BxTxD):
        scale = self.hooks.weight(
            layers.param(self, "scale", (self.cfg.d_model,), ("embed",), nn.initializers.ones),
            ("embed",), jnp.float32)
        return layers.rms_norm(x_BxTxD, scale, self.cfg.rms_eps)


class Block(nn.Module):
    """One pre-norm Llama block (block.pre_norm); scanned over `layers` by
    Llama. `dense_mlp`: a dense MLP of d_mlp in a mixture of experts (its
    first first_k_dense_replace layers)."""

    cfg: LlamaConfig
    hooks: Hooks
    dense_mlp: bool = False

    @nn.compact
    def __call__(self, x_BxTxD, segments_BxT):
        c, h = self.cfg, self.hooks
        D, H, K, Q, F = c.d_model, c.n_head, c.n_kv_head, c.q_dim, c.d_mlp
        normal = nn.initializers.normal(0.02)
        residual = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))
        param = functools.partial(layers.param, self)

        def dense(eq, x, name, shape, names, init=normal):  # the block's projections: FP8 where asked
            return layers.projection(self, h, eq, x, name, shape, names, init)

        def bias(x, name, shape, names):
            return block.add_bias(h, param, x, name, shape, names) if c.qkv_bias else x

        def attention(y):
            if c.mla:  # DeepSeek's multi-head latent attention
                return mla.attention(self, h, c, dense, y, segments_BxT)
            q = bias(dense("btd,dhq->bthq", y, "w_q", (D, H, Q), ("embed", "heads", "kv")),
                     "b_q", (H, Q), ("heads", "kv"))
            k = bias(dense("btd,dhq->bthq", y, "w_k", (D, K, Q), ("embed", "kv_heads", "kv")),
                     "b_k", (K, Q), ("kv_heads", "kv"))
            v = bias(dense("btd,dhq->bthq", y, "w_v", (D, K, Q), ("embed", "kv_heads", "kv")),
                     "b_v", (K, Q), ("kv_heads", "kv"))
            if c.qk_norm:  # Qwen3: each head's q and k normalised over its Q dimensions
                q, k = (_head_norm(c, h, param, x, name)
                        for x, name in ((q, "q_norm"), (k, "k_norm")))
            inv_freq = layers.rope_frequencies(Q, c.rope_theta, c.rope_scaling)
            at = h.positions(y.shape[1], segments_BxT)  # laid out over `context`
            if at is None and segments_BxT is not None:
                at = layers.positions(segments_BxT)
            q = h.act(layers.rope(q, inv_freq, at), ("batch", "seq", "heads", "kv"), name="qkv")
            k = h.act(layers.rope(k, inv_freq, at), ("batch", "seq", "kv_heads", "kv"), name="qkv")
            v = h.act(v, ("batch", "seq", "kv_heads", "kv"), name="qkv")
            att_BxTxHxQ = block.attend(h, q, k, v, segments_BxT, window=c.sliding_window)
            return dense("bthq,hqd->btd", att_BxTxHxQ, "w_o", (H, Q, D),
                         ("heads", "kv", "embed"), residual)

        def mlp(y):
            if c.n_experts and not self.dense_mlp:
                return moe.MoEMLP(c, h, name="moe")(y)
            return _swiglu(h, dense, y, D, F, residual), None

        return block.pre_norm(h, x_BxTxD, RMSNorm(c, h, name="attn_norm"), attention,
                              RMSNorm(c, h, name="mlp_norm"), mlp)


def _head_norm(c: LlamaConfig, h: Hooks, param, x_BxTxHxQ, name: str):
    """RMSNorm of each head over its Q dimensions, one scale for every head."""
    scale = h.weight(param(name, (c.q_dim,), ("kv",), nn.initializers.ones), ("kv",), jnp.float32)
    return layers.rms_norm(x_BxTxHxQ, scale, c.rms_eps)


def _swiglu(h: Hooks, dense, y_BxTxD, D: int, F: int, residual):
    """The dense SwiGLU MLP: gate and up column-parallel, down row-parallel."""
    gate = h.act(dense("btd,df->btf", y_BxTxD, "w_gate", (D, F), ("embed", "mlp")),
                 ("batch", "seq", "mlp"), name="mlp_hidden")
    up = h.act(dense("btd,df->btf", y_BxTxD, "w_up", (D, F), ("embed", "mlp")),
               ("batch", "seq", "mlp"), name="mlp_hidden")
    hid_BxTxF = h.act(jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype) * up,
                      ("batch", "seq", "mlp"), name="mlp_act")
    return dense("btf,fd->btd", hid_BxTxF, "w_down", (F, D), ("mlp", "embed"), residual)


class MTP(nn.Module):
    """One multi-token prediction module (DeepSeek-V3, 2.2): the previous
    depth's hidden states and the embeddings of the tokens one further
    ahead, each RMS-normed, concatenated (embeddings first, as DeepSeek's
    checkpoints' eh_proj reads them) and projected back to D, then one
    block; returns its output and that output normed for the shared head."""

    cfg: LlamaConfig
    hooks: Hooks

    @nn.compact
    def __call__(self, h_BxTxD, ahead_BxTxD, segments_BxT):
        c, h = self.cfg, self.hooks
        both = jnp.concatenate([RMSNorm(c, h, name="enorm")(ahead_BxTxD),
                                RMSNorm(c, h, name="hnorm")(h_BxTxD)], axis=-1)
        w = layers.param(self, "w_eh", (2 * c.d_model, c.d_model), (None, "embed"),
                         nn.initializers.normal(0.02))
        x = h.act(h.dense("btc,cd->btd", both, w, (None, "embed")), block.RESIDUAL)
        x, _ = Block(c, h, dense_mlp=not c.n_experts, name="block")(x, segments_BxT)
        return x, RMSNorm(c, h, name="norm")(x)


def stack(cfg, hooks: Hooks) -> nn.Module:
    """The scanned stack of cfg.n_layer blocks, or of the mixtures after the
    first first_k_dense_replace (a pipeline stage uses fewer)."""
    return decoder.scanned(Block, cfg, hooks, length=cfg.n_layer - cfg.first_k_dense_replace)


class Llama(nn.Module):
    """Token ids (B, T) -> logits (B, T, V); `embed`, `stack` and `head` are
    separate for a pipeline, as in the GPT."""

    cfg: LlamaConfig
    hooks: Hooks = Hooks()

    def setup(self):
        c = self.cfg
        table = self.hooks.table_shape
        normal = nn.initializers.normal(0.02)
        self.wte = layers.param(self, "wte", table((c.padded_vocab, c.d_model), ("vocab", "embed")),
                                ("vocab", "embed"), normal)
        if not c.tie_embeddings:
            self.w_head = layers.param(self, "w_head",
                                       table((c.padded_vocab, c.d_model), ("vocab", "embed")),
                                       ("vocab", "embed"), normal)
        self.blocks = stack(c, self.hooks)
        if c.first_k_dense_replace:  # their own stack: their MLP is another shape
            self.dense_blocks = decoder.scanned(Block, c, self.hooks,
                                                length=c.first_k_dense_replace, dense_mlp=True)
        self.norm_f = RMSNorm(c, self.hooks)
        self.mtp = [MTP(c, self.hooks) for _ in range(c.mtp_depth)]

    def embed(self, tokens_BxT, wte=None, segments_BxT=None):
        """The tokens' embeddings, through the dense layers that come before
        a mixture's (so that a pipeline's first stage runs them)."""
        h = self.hooks
        if tokens_BxT.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens_BxT.shape[1]} exceeds the model's "
                             f"max_seq_len={self.cfg.max_seq_len}")
        x = h.lookup(self.wte if wte is None else wte, tokens_BxT, ("vocab", "embed"))
        x = h.act(x, ("batch", "seq", "embed"))
        x = h.act(x, ("batch", "res_seq", "embed"))
        if self.cfg.first_k_dense_replace:
            x, _ = self.dense_blocks(x, segments_BxT)
        return x

    def stack(self, x_BxTxD, segments_BxT=None):
        x_BxTxD, _ = self.blocks(x_BxTxD, segments_BxT)
        return x_BxTxD

    def head(self, x_BxTxD, wte=None, normed=False):
        """Logits of x (`normed`: x has been normed already, by an MTP module)."""
        h = self.hooks
        y = h.act(x_BxTxD if normed else self.norm_f(x_BxTxD), ("batch", "seq", "embed"))
        w = (self.wte if wte is None else wte) if self.cfg.tie_embeddings else self.w_head
        logits_BxTxV = h.act(h.dense("btd,vd->btv", y, w, ("vocab", "embed")),
                             ("batch", "seq", "vocab"))
        if self.cfg.padded_vocab != self.cfg.vocab_size:
            real_V = h.vocab_ids(logits_BxTxV.shape[-1]) < self.cfg.vocab_size
            logits_BxTxV = jnp.where(real_V, logits_BxTxV, jnp.finfo(logits_BxTxV.dtype).min)
        return logits_BxTxV

    def __call__(self, tokens_BxT, segments_BxT=None, mtp_rows=None):
        """Logits; for a mixture of experts, with the router's per-layer,
        per-row statistics (moe.row_stats, stacked over layers). With
        multi-token prediction, given `mtp_rows` (each depth's tokens
        ahead, targets and weights: context/order.py `ahead`), the
        statistics carry its loss, the weighted sum over depths ("mtp_loss")."""
        c = self.cfg
        wte = self.hooks.gathered(self.wte, ("vocab", "embed")) if c.tie_embeddings else None
        x_BxTxD, stats = self.blocks(self.embed(tokens_BxT, wte, segments_BxT), segments_BxT)
        logits = self.head(x_BxTxD, wte)
        if c.mtp_depth and mtp_rows is None and self.is_initializing():  # declare their parameters
            mtp_rows = [(tokens_BxT, tokens_BxT, jnp.zeros(tokens_BxT.shape))] * c.mtp_depth
        if c.mtp_depth and mtp_rows is not None:
            stats = {**(stats or {}),
                     "mtp_loss": self.mtp_loss(x_BxTxD, mtp_rows, segments_BxT, wte)}
        return (logits, stats) if c.n_experts or c.mtp_depth else logits

    def mtp_loss(self, x_BxTxD, mtp_rows, segments_BxT, wte):
        """The MTP modules' next-token losses, each a weighted sum, summed."""
        h, total = self.hooks, 0.0
        for module, (ahead_BxT, targets_BxT, weights_BxT) in zip(self.mtp, mtp_rows):
            ahead = h.lookup(self.wte if wte is None else wte, ahead_BxT, ("vocab", "embed"))
            x_BxTxD, normed = module(x_BxTxD, h.act(ahead, block.RESIDUAL), segments_BxT)
            total = total + loss_lib.cross_entropy(self.head(normed, wte, normed=True),
                                                   targets_BxT, weights_BxT)
        return total


def penalty_of(cfg: LlamaConfig):
    """The terms the model adds to the training loss, from its statistics:
    the router's losses (moe.penalty) and the MTP modules' mean loss times
    mtp_loss_weight; None for a dense model without MTP."""
    router = functools.partial(moe.penalty, aux_coef=cfg.router_aux_loss_coef,
                               z_coef=cfg.router_z_loss_coef) if cfg.n_experts else None
    if not cfg.mtp_depth:
        return router

    def penalty(stats, row_weights_B, layers=None):
        added, metrics = router(stats, row_weights_B, layers=layers) if router else (0.0, {})
        if "mtp_loss" in stats:  # not in a pipeline stage's (the model is not pipelined)
            mtp = stats["mtp_loss"] / cfg.mtp_depth
            added, metrics = added + cfg.mtp_loss_weight * mtp, {**metrics, "mtp_loss": mtp}
        return added, metrics
    return penalty


def model_fns(cfg: LlamaConfig) -> ModelFns:
    """The Llama as the zero_jax train step sees it."""
    stacked = cfg.n_layer - cfg.first_k_dense_replace
    fns = decoder.fns(Llama, Block, cfg, penalty_of(cfg), stacked)
    if cfg.mtp_depth:  # its modules follow the head, which no pipeline stage runs
        fns["pipeline"] = None
    return ModelFns(**fns,
                    vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len,
                    layers=stacked, flops_per_token=cfg.flops_per_token,
                    block_ops=cfg.block_ops,
                    activation_bytes=cfg.activation_bytes, config=cfg,
                    gathered_once=("wte",) if cfg.tie_embeddings else (),
                    head_cost=cfg.head_cost, replicable={"kv_heads": cfg.n_kv_head},
                    experts=cfg.n_experts, balance_rate=cfg.router_bias_update_rate,
                    mtp_depth=cfg.mtp_depth)
