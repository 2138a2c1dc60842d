"""The decoder behind Llama 2 and 3, Mistral, Qwen2, and the mixtures of
experts Mixtral and Qwen3-MoE, in Flax: RMSNorm, rotary embeddings (Hugging
Face's half-rotation layout), SwiGLU MLP or a mixture of SwiGLU experts
(models/llama/moe.py), grouped-query attention, an untied head (tied as an
option), q/k/v biases for Qwen2, q/k norms for Qwen3, and no other biases;
the blocks are one scanned, stacked layer.

The model names logical axes only; `Hooks` (zero_jax.model.hooks) turn them into
sharding constraints, exactly as for the GPT (models/gpt/model.py), so every ZeRO
stage, tensor and sequence parallelism, pipelines and remat apply unchanged.
Key/value heads have their own logical axis, `kv_heads`: split over `tensor`
where it divides them, else replicated within the tensor group (job.py).
Tensor names carry their shapes: B batch, T sequence, D model width, H query
heads, K key/value heads, Q head size, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import block, decoder, layers
from models.llama import moe
from models.llama.presets import PRESETS
from zero_jax.model.hooks import Hooks
from zero_jax.model.contract import ModelFns, Op
from zero_jax.model.remat import Remat


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family model."""

    vocab_size: int  # tokens the data can produce
    n_layer: int  # transformer blocks (L)
    n_head: int  # query heads (H)
    n_kv_head: int  # key/value heads (K), dividing H: grouped-query attention
    d_model: int  # residual width (D)
    d_mlp: int  # SwiGLU hidden width (F)
    max_seq_len: int  # longest sequence (rotary embeddings need no table)
    head_dim: int = 0  # Q (0: D / H)
    rope_theta: float = 10000.0  # rotary base
    rms_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # the head is the embedding table
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    sliding_window: int = 0  # each query sees the last this many positions (0: all)
    # Llama 3 rope scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), or () for none
    rope_scaling: tuple = ()
    vocab_multiple: int = 1  # embedding rows padded to a multiple of this (masked in the logits)
    family: str = "llama"  # llama | mistral | qwen2 | mixtral | qwen2_moe | qwen3_moe: the HF architecture
    qk_norm: bool = False  # RMSNorm of each head's q and k before rotation (Qwen3)
    # A mixture of experts (models/llama/moe.py) in place of every block's MLP:
    n_experts: int = 0  # routed experts (0: a dense MLP)
    n_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    d_expert: int = 0  # each expert's SwiGLU width (0: d_mlp)
    n_shared_experts: int = 0  # always-on experts beside the routed ones (DeepSeek, Qwen2-MoE)
    d_shared: int = 0  # their SwiGLU width together (0: n_shared_experts x the expert width)
    shared_expert_gate: bool = False  # a sigmoid of x w (w: D x 1) scales their output (Qwen2-MoE)
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to one
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the training loss
    router_z_loss_coef: float = 0.0  # weight of the router z-loss in the training loss
    capacity_factor: float = 0.0  # > 0: each expert takes at most this times its even share (drops)

    def __post_init__(self):
        if self.n_experts and not 0 < self.n_experts_per_tok <= self.n_experts:
            raise ValueError(f"n_experts_per_tok={self.n_experts_per_tok} with n_experts="
                             f"{self.n_experts}: each token goes to between 1 and n_experts "
                             "experts; choose a top-k in that range")
        if not self.n_experts and (self.n_experts_per_tok or self.n_shared_experts):
            raise ValueError("n_experts_per_tok / n_shared_experts given without n_experts: "
                             "set n_experts for a mixture of experts")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if not self.head_dim and self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                             "give head_dim")
        if self.rope_scaling and len(self.rope_scaling) != 4:
            raise ValueError("rope_scaling: (factor, low_freq_factor, high_freq_factor, "
                             "original_max_position_embeddings)")

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def q_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def expert_mlp(self) -> int:
        """Each expert's SwiGLU width."""
        return self.d_expert or self.d_mlp

    @property
    def shared_mlp(self) -> int:
        """The shared experts' SwiGLU width together."""
        return self.d_shared or self.n_shared_experts * self.expert_mlp

    def _mlp_params(self, active: bool) -> int:
        """One block's MLP matrices: every expert's, or (`active`) those a
        token computes with: its k experts, the shared ones and the router."""
        D = self.d_model
        if not self.n_experts:
            return 3 * D * self.d_mlp
        experts = self.n_experts_per_tok if active else self.n_experts
        return (3 * D * (self.expert_mlp * experts + self.shared_mlp) + D * self.n_experts
                + (D if self.shared_expert_gate else 0))

    def _attn_params(self) -> int:
        D, Q, H, K = self.d_model, self.q_dim, self.n_head, self.n_kv_head
        return D * H * Q + 2 * D * K * Q + H * Q * D

    @property
    def param_count(self) -> int:
        D, L, Q = self.d_model, self.n_layer, self.q_dim
        H, K = self.n_head, self.n_kv_head
        attn = self._attn_params() + ((H + 2 * K) * Q if self.qkv_bias else 0) \
            + (2 * Q if self.qk_norm else 0)
        per_layer = 2 * D + attn + self._mlp_params(active=False)
        tables = self.padded_vocab * D * (1 if self.tie_embeddings else 2)
        return tables + L * per_layer + D

    @property
    def active_param_count(self) -> int:
        """Parameters a token computes with (all of them in a dense model)."""
        return self.param_count - self.n_layer * (self._mlp_params(False) - self._mlp_params(True))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6 N + 12 L H Q T (PaLM, appendix B), N
        the matmul parameters a token computes with, including the head: in
        a mixture of experts its k experts, the shared ones and the router."""
        L, Q, H = self.n_layer, self.q_dim, self.n_head
        n_matmul = L * (self._attn_params() + self._mlp_params(active=True)) \
            + self.padded_vocab * self.d_model
        return 6 * n_matmul + 12 * L * H * Q * seq_len

    def block_ops(self, seq_len: int) -> list[Op]:
        """One block as the tensors `Block` computes, named as it names them
        (contract.Op): what a remat policy recomputes."""
        D, H, K, Q = self.d_model, self.n_head, self.n_kv_head, self.q_dim
        # A mixture of experts computes its k experts (and shared ones) per token.
        F = self.active_mlp
        return block.ops(seq_len, D, H, Q, qkv_features=(H + 2 * K) * Q, mlp=[
            Op("gate", "mlp_hidden", 2 * D * F, ("norm_2",), dot=True, width=F, split="out"),
            Op("up", "mlp_hidden", 2 * D * F, ("norm_2",), dot=True, width=F, split="out"),
            Op("act", "mlp_act", 0, ("gate", "up"), width=F, split="out"),
            Op("down", None, 2 * F * D, ("act",), dot=True, width=D, split="in")])

    @property
    def active_mlp(self) -> int:
        """The SwiGLU width a token computes with: d_mlp, or its k experts'
        and the shared experts' widths together."""
        if not self.n_experts:
            return self.d_mlp
        return self.expert_mlp * self.n_experts_per_tok + self.shared_mlp

    def head_cost(self, seq_len: int) -> float:
        """The head's forward FLOPs in units of one block's forward."""
        D, F, Q, H, K = self.d_model, self.active_mlp, self.q_dim, self.n_head, self.n_kv_head
        block_flops = 2 * (2 * D * H * Q + 2 * D * K * Q + 3 * D * F) + 4 * seq_len * H * Q
        return 2 * self.padded_vocab * D / block_flops

    def activation_bytes(self, rows: int, seq_len: int, dtype_bytes: int, remat: Remat,
                         tensor: int = 1, sequence_parallel: bool = False,
                         attention: str = "xla", context: int = 1,
                         context_attention: str = "") -> float:
        kept, rebuilt, head = self.activation_parts(rows, seq_len, dtype_bytes, remat, tensor,
                                                    sequence_parallel, attention, context,
                                                    context_attention)
        return kept + max(rebuilt, head)

    def activation_parts(self, rows: int, seq_len: int, dtype_bytes: int, remat: Remat,
                         tensor: int = 1, sequence_parallel: bool = False,
                         attention: str = "xla", context: int = 1,
                         context_attention: str = "") -> decoder.ActivationParts:
        """Activation bytes per device for one microbatch (models/gpt/model.py
        has the method). Per layer the block names: the block input, both norm
        outputs and the residual after attention (4 s b h), q, k, v and the
        attention context ((2 H + 2 K) Q s b / t), the attention
        probabilities (a s^2 b / t; none under cuDNN's fused attention), the
        SwiGLU gate and up projections and their product (3 s b f / t).
        Over `context` every per-token tensor is a c-th (s / c tokens), and
        the probabilities are `layers.attention_probs`'s; Ulysses also keeps
        its head-split q, k and v (k and v repeated to the heads where c
        does not divide the kv heads), ring its log-sum-exp."""
        # A mixture of experts keeps its k copies' (and shared experts') hidden
        # widths per token, and the copies themselves (k s b h, dropless).
        b, h, f, L, t = rows, self.d_model, self.active_mlp, self.n_layer, tensor
        s = seq_len / context
        H, K, Q = self.n_head, self.n_kv_head, self.q_dim
        res = s * b * h / (t if sequence_parallel else 1)
        full = s * b * h
        q = s * b * H * Q / t
        kv = s * b * K * Q / (t if K % t == 0 else 1)  # replicated where tensor does not divide K
        mlp = s * b * f / t
        probs = layers.attention_probs(H, seq_len, b, t, attention, context, context_attention)
        named = {"ln_out": 2 * res, "qkv": q + 2 * kv, "attn_probs": probs, "attn_ctx": q,
                 "resid_mid": res, "mlp_hidden": 2 * mlp, "mlp_act": mlp}
        if context_attention == "ulysses":
            local_kv = K // t if K % t == 0 else K
            named["qkv"] += q + 2 * (kv if local_kv % context == 0 else q)
        elif context_attention == "ring":
            named["attn_ctx"] += s * b * H / t
        copies = self.n_experts_per_tok * full if self.n_experts else 0
        layer = res + sum(named.values()) + copies
        kept = {
            "none": L * layer,
            "full": L * res,
            "dots_saveable": L * (res + q + 2 * kv + probs + q + full + 2 * mlp + full),
            "save_names": L * (res + sum(named.get(n, 0) for n in remat.names)),
            "offload": L * res,
        }[remat.policy]
        rebuilt = 0 if remat.policy == "none" else layer
        head = 3 * s * b * self.padded_vocab / t * 4 / dtype_bytes + 2 * res
        return decoder.ActivationParts(kept * dtype_bytes, rebuilt * dtype_bytes, head * dtype_bytes)




def config(name: str, data_vocab: int, **overrides) -> LlamaConfig:
    """A preset's shape with any field overridden (zero/empty values are not
    overrides); `data_vocab` where neither names a vocabulary."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; Llama-family presets: {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **decoder.given(overrides)}
    fields["vocab_size"] = fields["vocab_size"] or data_vocab
    return LlamaConfig(**fields)


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
    """One pre-norm Llama block (block.pre_norm); scanned over `layers` by Llama."""

    cfg: LlamaConfig
    hooks: Hooks

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
            if c.n_experts:
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


def stack(cfg, hooks: Hooks) -> nn.Module:
    """The scanned stack of cfg.n_layer blocks (a pipeline stage uses fewer)."""
    return decoder.scanned(Block, cfg, hooks)


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
        self.norm_f = RMSNorm(c, self.hooks)

    def embed(self, tokens_BxT, wte=None):
        h = self.hooks
        if tokens_BxT.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens_BxT.shape[1]} exceeds the model's "
                             f"max_seq_len={self.cfg.max_seq_len}")
        x = h.lookup(self.wte if wte is None else wte, tokens_BxT, ("vocab", "embed"))
        x = h.act(x, ("batch", "seq", "embed"))
        return h.act(x, ("batch", "res_seq", "embed"))

    def stack(self, x_BxTxD, segments_BxT=None):
        x_BxTxD, _ = self.blocks(x_BxTxD, segments_BxT)
        return x_BxTxD

    def head(self, x_BxTxD, wte=None):
        h = self.hooks
        y = h.act(self.norm_f(x_BxTxD), ("batch", "seq", "embed"))
        w = (self.wte if wte is None else wte) if self.cfg.tie_embeddings else self.w_head
        logits_BxTxV = h.act(h.dense("btd,vd->btv", y, w, ("vocab", "embed")),
                             ("batch", "seq", "vocab"))
        if self.cfg.padded_vocab != self.cfg.vocab_size:
            real_V = h.vocab_ids(logits_BxTxV.shape[-1]) < self.cfg.vocab_size
            logits_BxTxV = jnp.where(real_V, logits_BxTxV, jnp.finfo(logits_BxTxV.dtype).min)
        return logits_BxTxV

    def __call__(self, tokens_BxT, segments_BxT=None):
        """Logits; for a mixture of experts, with the router's per-layer,
        per-row statistics (moe.row_stats, stacked over layers)."""
        wte = self.hooks.gathered(self.wte, ("vocab", "embed")) if self.cfg.tie_embeddings else None
        x_BxTxD, stats = self.blocks(self.embed(tokens_BxT, wte), segments_BxT)
        logits = self.head(x_BxTxD, wte)
        return (logits, stats) if self.cfg.n_experts else logits


def model_fns(cfg: LlamaConfig) -> ModelFns:
    """The Llama as the zero_jax train step sees it."""
    penalty = functools.partial(moe.penalty, aux_coef=cfg.router_aux_loss_coef,
                                z_coef=cfg.router_z_loss_coef) if cfg.n_experts else None
    return ModelFns(**decoder.fns(Llama, Block, cfg, penalty), vocab_size=cfg.vocab_size,
                    max_seq_len=cfg.max_seq_len,
                    layers=cfg.n_layer, flops_per_token=cfg.flops_per_token,
                    block_ops=cfg.block_ops,
                    activation_bytes=cfg.activation_bytes, config=cfg,
                    gathered_once=("wte",) if cfg.tie_embeddings else (),
                    head_cost=cfg.head_cost, replicable={"kv_heads": cfg.n_kv_head},
                    experts=cfg.n_experts)
