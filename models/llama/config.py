"""The Llama family's shape: one frozen dataclass (`LlamaConfig`) for
every architecture the family covers (Llama, Mistral, Qwen2, Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and Kimi-K2), with what is computed
from it alone: parameter counts, FLOPs per token, one block as
contract.Op's, and activation bytes; and a preset by name (`config`).

Names: D model width, H query heads, K key/value heads, Q each head's q/k
width, Q_v its value width, F MLP width, L layers, E experts, k experts
per token, s b tokens of a microbatch, t the tensor axis.
"""

from __future__ import annotations

import dataclasses

from models.common import block, decoder, layers
from models.llama.presets import PRESETS
from zero_jax.model.contract import Op
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
    # DeepSeekMoE (DeepSeek-V3, Kimi-K2): sigmoid scores, the chosen k's
    # weights times routed_scaling_factor; the experts in n_group groups, a
    # token's from its topk_group best (group-limited routing); a selection
    # bias per expert moved by router_bias_update_rate a step against the
    # load error (aux-loss-free balancing, zero_jax/model/balance.py); the
    # first first_k_dense_replace layers with a dense MLP of d_mlp.
    score_func: str = "softmax"  # softmax | sigmoid
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    expert_bias: bool = False  # a per-expert bias added to the scores for selection only
    router_bias_update_rate: float = 0.0  # its step against the load error (0: fixed)
    first_k_dense_replace: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3), where kv_lora_rank > 0:
    # keys and values from one normed rank-kv_lora_rank compression of the
    # input, queries from a normed rank-q_lora_rank one (0: a full
    # projection); each head's q and k have qk_nope_head_dim unrotated
    # dimensions and qk_rope_head_dim rotated ones, the rotated key one for
    # every head; values have v_head_dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN rope scaling (DeepSeek-V3): (factor, original_max_position_embeddings,
    # beta_fast, beta_slow, mscale, mscale_all_dim), or () for none
    rope_yarn: tuple = ()
    # Multi-token prediction (DeepSeek-V3, 2.2): mtp_depth modules, module k
    # predicting the token k + 1 ahead from module k - 1's output and the
    # embedding of the token k ahead, through one more block, with the
    # shared embedding and head; their mean loss weighted by mtp_loss_weight.
    # Training only: the export leaves them out.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.0

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
        self._check_deepseek()
        if self.rope_scaling and len(self.rope_scaling) != 4:
            raise ValueError("rope_scaling: (factor, low_freq_factor, high_freq_factor, "
                             "original_max_position_embeddings)")

    def _check_deepseek(self):
        """DeepSeekMoE's and MLA's fields agree with each other."""
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={self.score_func!r}: choose softmax or sigmoid")
        if self.n_experts and self.n_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide n_experts={self.n_experts}: "
                             "the experts are split into equal groups")
        if self.n_group > 1 and not (
                0 < self.topk_group <= self.n_group
                and self.topk_group * self.n_experts // self.n_group >= self.n_experts_per_tok):
            raise ValueError(f"topk_group={self.topk_group} of n_group={self.n_group}: a token's "
                             f"{self.n_experts_per_tok} experts must fit in its topk_group groups "
                             f"of {self.n_experts // self.n_group}; choose a larger topk_group")
        if self.router_bias_update_rate and not self.expert_bias:
            raise ValueError("router_bias_update_rate without expert_bias: the rate moves the "
                             "experts' selection bias; set expert_bias")
        if not 0 <= self.first_k_dense_replace <= self.n_layer or (
                self.first_k_dense_replace and not self.n_experts):
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace}: between 0 and "
                             f"n_layer={self.n_layer}, in a mixture of experts")
        if self.mla and not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim
                             and self.qk_rope_head_dim % 2 == 0):
            raise ValueError("kv_lora_rank > 0 (latent attention) needs qk_nope_head_dim, "
                             "v_head_dim and an even qk_rope_head_dim")
        if self.mtp_depth < 0:  # 0 turns multi-token prediction off, whatever its weight
            raise ValueError(f"mtp_depth={self.mtp_depth}: 0 (none) or more modules")
        if self.rope_yarn and len(self.rope_yarn) != 6:
            raise ValueError("rope_yarn: (factor, original_max_position_embeddings, beta_fast, "
                             "beta_slow, mscale, mscale_all_dim)")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention in place of grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the mixture (all of them, or those after the dense ones)."""
        return self.n_layer - self.first_k_dense_replace if self.n_experts else 0

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def q_dim(self) -> int:
        """Each head's q and k width (latent attention: unrotated and rotated)."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.n_head

    @property
    def v_dim(self) -> int:
        """Each head's value width."""
        return self.v_head_dim if self.mla else self.q_dim

    @property
    def expert_mlp(self) -> int:
        """Each expert's SwiGLU width."""
        return self.d_expert or self.d_mlp

    @property
    def shared_mlp(self) -> int:
        """The shared experts' SwiGLU width together."""
        return self.d_shared or self.n_shared_experts * self.expert_mlp

    def _mlp_params(self, active: bool) -> int:
        """One mixture layer's MLP parameters (a dense model's MLP): every
        expert's and the selection bias, or (`active`) those a token
        computes with: its k experts, the shared ones and the router."""
        D = self.d_model
        if not self.n_experts:
            return 3 * D * self.d_mlp
        experts = self.n_experts_per_tok if active else self.n_experts
        return (3 * D * (self.expert_mlp * experts + self.shared_mlp) + D * self.n_experts
                + (D if self.shared_expert_gate else 0)
                + (self.n_experts if self.expert_bias and not active else 0))

    def _mlps(self, active: bool) -> int:
        """Every layer's MLP: the dense layers' and the mixtures'."""
        dense = self.n_layer - self.moe_layers
        return dense * 3 * self.d_model * self.d_mlp + self.moe_layers * (
            self._mlp_params(active) if self.n_experts else 0)

    def _attn_params(self) -> int:
        """One layer's attention matrices."""
        D, Q, H, K, V = self.d_model, self.q_dim, self.n_head, self.n_kv_head, self.v_dim
        if not self.mla:
            return D * H * Q + 2 * D * K * Q + H * Q * D
        R, C = self.q_lora_rank, self.kv_lora_rank
        q = D * R + R * H * Q if R else D * H * Q
        return q + D * (C + self.qk_rope_head_dim) + C * H * (self.qk_nope_head_dim + V) \
            + H * V * D

    def _attn_vectors(self) -> int:
        """One layer's attention norms and biases."""
        Q, H, K = self.q_dim, self.n_head, self.n_kv_head
        if self.mla:  # the two compressions' norms
            return self.q_lora_rank + self.kv_lora_rank
        return ((H + 2 * K) * Q if self.qkv_bias else 0) + (2 * Q if self.qk_norm else 0)

    def _mtp_params(self, active: bool) -> int:
        """One multi-token prediction module: its two input norms, the (2 D,
        D) projection, one block (a mixture's where the model is one) and
        its output norm; the embedding and head are the model's."""
        D = self.d_model
        block = 2 * D + self._attn_params() + self._attn_vectors() + self._mlp_params(active)
        return 2 * D + 2 * D * D + block + D

    @property
    def param_count(self) -> int:
        D, L = self.d_model, self.n_layer
        per_layer = 2 * D + self._attn_params() + self._attn_vectors()
        tables = self.padded_vocab * D * (1 if self.tie_embeddings else 2)
        return (tables + L * per_layer + self._mlps(active=False) + D
                + self.mtp_depth * self._mtp_params(active=False))

    @property
    def active_param_count(self) -> int:
        """Parameters a token computes with (all of them in a dense model)."""
        return self.param_count - (self._mlps(False) - self._mlps(True)) \
            - self.mtp_depth * (self._mtp_params(False) - self._mtp_params(True))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6 N + 6 L H (Q + Q_v) T (PaLM,
        appendix B: 12 L H Q T where q.k and values have one width), N the
        matmul parameters a token computes with, including the head: in a
        mixture of experts its k experts, the shared ones and the router;
        each multi-token prediction module adds a block, its projection and
        the head once more."""
        L, H, D = self.n_layer + self.mtp_depth, self.n_head, self.d_model
        head = self.padded_vocab * D
        n_matmul = L * self._attn_params() + self._mlps(active=True) + head + self.mtp_depth * (
            2 * D * D + self._mlp_params(active=True) + head)
        return 6 * n_matmul + 6 * L * H * (self.q_dim + self.v_dim) * seq_len

    def block_ops(self, seq_len: int) -> list[Op]:
        """One block as the tensors `Block` computes, named as it names them
        (contract.Op): what a remat policy recomputes. A mixture's block
        where the first layers are dense."""
        D, H, K, Q = self.d_model, self.n_head, self.n_kv_head, self.q_dim
        # A mixture of experts computes its k experts (and shared ones) per token.
        F = self.active_mlp
        qkv = self._attn_params() // D - H * self.v_dim if self.mla else (H + 2 * K) * Q
        return block.ops(seq_len, D, H, Q, qkv_features=qkv, value_dim=self.v_dim, mlp=[
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
        D, F, H = self.d_model, self.active_mlp, self.n_head
        block_flops = 2 * (self._attn_params() + 3 * D * F) \
            + 2 * seq_len * H * (self.q_dim + self.v_dim)
        return 2 * self.padded_vocab * D / block_flops

    def activation_bytes(self, rows: int, seq_len: int, dtype_bytes: int, remat: Remat,
                         tensor: int = 1, sequence_parallel: bool = False,
                         attention: str = "xla", context: int = 1,
                         context_attention: str = "", expert: int = 1) -> float:
        """At the backward pass's peak (`ActivationParts.peak`), with a
        mixture's dispatch buffers over `expert` devices (`dispatch_parts`)."""
        parts = self.activation_parts(rows, seq_len, dtype_bytes, remat, tensor,
                                      sequence_parallel, attention, context, context_attention)
        extra = self.dispatch_parts(rows, seq_len, dtype_bytes, remat, expert, tensor, context)
        return parts.plus(extra).peak

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
        does not divide the kv heads), ring its log-sum-exp. Latent attention
        keeps q, k and v per head (H (2 Q + Q_v) s b / t) and its compressions,
        whole on every tensor rank ((r_q + r_kv + Q_rope) s b: `q_latent`, `kv_latent`)."""
        b, h, L, t = rows, self.d_model, self.n_layer, tensor
        s = seq_len / context
        H, K, Q = self.n_head, self.n_kv_head, self.q_dim
        res = s * b * h / (t if sequence_parallel else 1)
        full = s * b * h
        q = s * b * H * Q / t
        kv = s * b * K * Q / (t if K % t == 0 else 1)  # replicated where tensor does not divide K
        probs = layers.attention_probs(H, seq_len, b, t, attention, context, context_attention)
        named = {"ln_out": 2 * res, "qkv": q + 2 * kv, "attn_probs": probs, "attn_ctx": q,
                 "resid_mid": res}
        if self.mla:
            v = s * b * H * self.v_dim / t
            named.update(qkv=2 * q + v, attn_ctx=v, q_latent=s * b * self.q_lora_rank,
                         kv_latent=s * b * (self.kv_lora_rank + self.qk_rope_head_dim))
        if context_attention == "ulysses":
            local_kv = K // t if K % t == 0 else K
            named["qkv"] += q + 2 * (kv if local_kv % context == 0 else q)
        elif context_attention == "ring":
            named["attn_ctx"] += s * b * H / t
        attn_dots = sum(named[n] for n in ("qkv", "attn_ctx")) + named.get("q_latent", 0) \
            + named.get("kv_latent", 0)
        # A mixture of experts keeps its k copies' (and shared experts') hidden
        # widths per token, and the copies themselves (k s b h, dropless); its
        # first first_k_dense_replace layers (if any) a dense MLP's.
        # A multi-token prediction module keeps one more block's (and its inputs').
        moe_blocks = self.moe_layers + (self.mtp_depth if self.n_experts else 0)
        kinds = [(self.n_layer - self.moe_layers + (0 if self.n_experts else self.mtp_depth),
                  self.d_mlp, 0),
                 (moe_blocks, self.active_mlp, self.n_experts_per_tok * full)]
        kept, rebuilt = 0.0, 0.0
        for count, f, copies in kinds:
            mlp = s * b * f / t
            mine = {**named, "mlp_hidden": 2 * mlp, "mlp_act": mlp}
            layer = res + sum(mine.values()) + copies
            kept += count * {
                "none": layer,
                "full": res,
                "dots_saveable": res + attn_dots + probs + full + 2 * mlp + full,
                "save_names": res + sum(mine.get(n, 0) for n in remat.names),
                "offload": res,
            }[remat.policy]
            rebuilt = max(rebuilt, 0 if remat.policy == "none" or not count else layer)
        head = 3 * s * b * self.padded_vocab / t * 4 / dtype_bytes + 2 * res
        return decoder.ActivationParts(kept * dtype_bytes, rebuilt * dtype_bytes, head * dtype_bytes)

    def dispatch_parts(self, rows: int, seq_len: int, dtype_bytes: int, remat: Remat,
                       expert: int, tensor: int = 1, context: int = 1) -> decoder.ActivationParts:
        """What a mixture layer holds beyond `activation_parts` when its
        experts split over `expert` > 1 devices (an estimate): dropless, a
        device receives into buffers sized for the worst case, every peer's
        A = k s b copies (models/llama/moe.py): the received copies, sorted,
        multiplied and scattered back (4 e A h), the expert hidden widths
        over e A rows instead of A (3 (e - 1) A f / t), and the copies
        returned (A h). Kept through the backward pass under `none` (every
        layer's), or the exchanged copies (e A h + A h and the ids) where the
        policy keeps `moe_exchange`; else one layer's, rebuilt."""
        zero = decoder.ActivationParts(0.0, 0.0, 0.0)
        if not self.n_experts or expert <= 1:
            return zero
        e, A, h = expert, self.n_experts_per_tok * rows * seq_len / context, self.d_model
        layer = (4 * e + 1) * A * h + 3 * (e - 1) * A * self.expert_mlp / tensor
        exchanged = e * A * h + A * h + e * A * 4 / dtype_bytes
        moe = self.moe_layers + self.mtp_depth
        if remat.policy == "none":
            return decoder.ActivationParts(moe * layer * dtype_bytes, 0.0, 0.0)
        kept = moe * exchanged if "moe_exchange" in remat.names else 0.0
        return decoder.ActivationParts(kept * dtype_bytes, layer * dtype_bytes, 0.0)


def config(name: str, data_vocab: int, **overrides) -> LlamaConfig:
    """A preset's shape with any field overridden (zero/empty values are not
    overrides); `data_vocab` where neither names a vocabulary."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; Llama-family presets: {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **decoder.given(overrides)}
    fields["vocab_size"] = fields["vocab_size"] or data_vocab
    return LlamaConfig(**fields)
