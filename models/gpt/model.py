"""GPT-2 style decoder in Flax: learned positions, pre-LayerNorm, GELU MLP,
tied embeddings, causal attention; the blocks are one scanned, stacked layer.

The model names logical axes only; `Hooks` (zero_jax.model.hooks) turn them into
sharding constraints. Tensor names carry their shapes: B batch, T sequence,
D model width, H heads, Q head size, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax.numpy as jnp

from models.common import block, decoder, layers
from zero_jax.model.hooks import Hooks
from zero_jax.model.contract import ModelFns, Op
from zero_jax.model.remat import Remat


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model."""

    vocab_size: int  # tokens the data can produce
    n_layer: int  # transformer blocks (L)
    n_head: int  # attention heads (H)
    d_model: int  # residual width (D); head size Q = D / H
    d_mlp: int  # MLP hidden width (F), 4 D in GPT-2
    max_seq_len: int  # rows of the learned position table
    vocab_multiple: int = 1  # embedding rows padded to a multiple of this (masked in the logits)
    ln_eps: float = 1e-5  # LayerNorm epsilon, as GPT-2

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding: the vocabulary rounded up to `vocab_multiple`.

        Padding lets `tensor` split the vocabulary (Megatron pads GPT-2's 50257
        to 50304 for the same reason); the padded ids never occur in the data
        and their logits are masked, so the model computes the same function.
        """
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def param_count(self) -> int:
        D, F, L = self.d_model, self.d_mlp, self.n_layer
        per_layer = 4 * D + (3 * D * D + 2 * D) + (D * D + D) + (D * F + F) + (F * D + D)
        return self.padded_vocab * D + self.max_seq_len * D + L * per_layer + 2 * D

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6 N + 12 L H Q T (PaLM, appendix B).

        N counts the non-embedding matmul parameters plus the tied output
        projection; the attention term is the full T x T product (not halved
        for the causal mask), as PaLM and the MFU figures it is compared with.
        """
        D, F, L = self.d_model, self.d_mlp, self.n_layer
        n_matmul = L * (4 * D * D + 2 * D * F) + self.padded_vocab * D
        return 6 * n_matmul + 12 * L * self.n_head * self.head_dim * seq_len

    def block_ops(self, seq_len: int) -> list[Op]:
        """One block as the tensors `Block` computes, named as it names them
        (contract.Op): what a remat policy recomputes."""
        D, F, H, Q = self.d_model, self.d_mlp, self.n_head, self.head_dim
        return block.ops(seq_len, D, H, Q, qkv_features=3 * H * Q, mlp=[
            Op("fc", "mlp_hidden", 2 * D * F, ("norm_2",), dot=True, width=F, split="out"),
            Op("gelu", "mlp_act", 0, ("fc",), width=F, split="out"),
            Op("proj", None, 2 * F * D, ("gelu",), dot=True, width=D, split="in")])

    def head_cost(self, seq_len: int) -> float:
        """The head's forward FLOPs in units of one block's forward (a pipeline
        schedule's cost): 2 V D against 8 D^2 + 4 D F + 4 T D per token."""
        D, F, V = self.d_model, self.d_mlp, self.padded_vocab
        return 2 * V * D / (8 * D * D + 4 * D * F + 4 * seq_len * D)

    def activation_bytes(self, rows: int, seq_len: int, dtype_bytes: int, remat: Remat,
                         tensor: int = 1, sequence_parallel: bool = False,
                         attention: str = "xla", context: int = 1,
                         context_attention: str = "", expert: int = 1) -> float:
        """Activation bytes one device holds at the peak of the backward pass,
        one microbatch (`activation_parts`): what the layers keep, and the
        larger of one rebuilt layer and the head. (`expert`: a GPT has no
        experts to split.)"""
        return self.activation_parts(rows, seq_len, dtype_bytes, remat, tensor,
                                     sequence_parallel, attention, context,
                                     context_attention).peak

    def activation_parts(self, rows: int, seq_len: int, dtype_bytes: int, remat: Remat,
                         tensor: int = 1, sequence_parallel: bool = False,
                         attention: str = "xla", context: int = 1,
                         context_attention: str = "") -> decoder.ActivationParts:
        """Activation bytes per device for one microbatch, in three parts.

        Per layer the block names what its backward pass needs (elements per
        device; t = tensor, residual-stream tensors also split by t under
        sequence parallelism): the block input, both LayerNorm outputs and the
        residual after attention (4 s b h), q, k, v and the attention context
        (4 s b h / t), the attention probabilities (a s^2 b / t; none under
        cuDNN's fused attention, `layers.attention_probs`) and the MLP hidden
        before and after GELU (2 s b f / t). `none` keeps all of it; the
        other policies keep less per layer and rebuild one layer at a time
        in the backward pass.

        The head's backward runs before any layer's, so its buffers and a
        rebuilt layer are never live together. The head holds three float32
        tensors of the logits' size (the logits, their exponentials, their
        gradient), as the compiled programs do.

        Over `context` every per-token tensor is a c-th (s / c tokens), and
        the probabilities are `layers.attention_probs`'s; Ulysses also keeps
        its head-split q, k and v, ring its log-sum-exp.
        """
        b, h, f, a, L = rows, self.d_model, self.d_mlp, self.n_head, self.n_layer
        s = seq_len / context
        t = tensor
        res = s * b * h / (t if sequence_parallel else 1)  # residual-stream tensor
        full = s * b * h  # a row-parallel product before its reduction
        split = s * b * h / t  # a tensor split over heads
        mlp = s * b * f / t
        probs = layers.attention_probs(a, seq_len, b, t, attention, context, context_attention)
        named = {"ln_out": 2 * res, "qkv": 3 * split, "attn_probs": probs, "attn_ctx": split,
                 "resid_mid": res, "mlp_hidden": mlp, "mlp_act": mlp}
        if context_attention == "ulysses":
            named["qkv"] += 3 * split
        elif context_attention == "ring":
            named["attn_ctx"] += s * b * a / t
        layer = res + sum(named.values())  # = 4 res + 4 split + probs + 2 mlp
        kept = {
            "none": L * layer,
            "full": L * res,
            "dots_saveable": L * (res + 3 * split + probs + split + full + mlp + full),
            "save_names": L * (res + sum(named.get(n, 0) for n in remat.names)),
            "offload": L * res,  # the named ones live in host memory
        }[remat.policy]
        rebuilt = 0 if remat.policy == "none" else layer
        head = 3 * s * b * self.padded_vocab / t * 4 / dtype_bytes + 2 * res
        return decoder.ActivationParts(kept * dtype_bytes, rebuilt * dtype_bytes, head * dtype_bytes)


# name -> (n_layer, n_head, d_model, max_seq_len, vocab_size); d_mlp = 4 d_model. A
# vocab_size of 0 takes the data's. The large ones are the published shapes
# (BLOOM uses ALiBi rather than learned positions; the shapes are what a plan needs).
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "gpt-tiny": (4, 8, 192, 256, 0),
    "gpt-small": (12, 12, 768, 1024, 0),
    "gpt-medium": (24, 16, 1024, 1024, 0),
    "gpt-large": (36, 20, 1280, 1024, 0),
    "gpt-xl": (48, 25, 1600, 1024, 0),
    "gpt-7b": (32, 32, 4096, 2048, 0),
    "gpt3-175b": (96, 96, 12288, 2048, 50257),  # Brown et al. 2020, table 2.1
    "bloom-176b": (70, 112, 14336, 2048, 250880),  # BigScience, tr11-176B-ml
    "mt-nlg-530b": (105, 128, 20480, 2048, 50257),  # Smith et al. 2022
}
SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "d_mlp", "vocab_size", "max_seq_len")


def config(name: str, data_vocab: int, **overrides) -> GPTConfig:
    """A preset's shape (or, with name "", none) with any field overridden.

    `data_vocab` is the data's vocabulary: it applies where neither the
    preset nor an override names one. Without a preset, n_layer, n_head and d_model are
    required; d_mlp defaults to 4 d_model and max_seq_len to 2048.
    """
    given = decoder.given(overrides)
    if name:
        if name not in PRESETS:
            raise ValueError(f"unknown model {name!r}; choose from {', '.join(PRESETS)}, or give "
                             f"every shape (--model '' --n-layer .. --n-head .. --d-model ..)")
        n_layer, n_head, d_model, max_seq_len, preset_vocab = PRESETS[name]
        fields = dict(vocab_size=preset_vocab or data_vocab, n_layer=n_layer, n_head=n_head,
                      d_model=d_model, max_seq_len=max_seq_len)
    else:
        missing = [k for k in ("n_layer", "n_head", "d_model") if k not in given]
        if missing:
            raise ValueError(f"no model preset, so the shape needs {', '.join(missing)}: give "
                             f"{' '.join('--' + k.replace('_', '-') for k in missing)}, or a "
                             f"preset with --model ({', '.join(PRESETS)})")
        fields = dict(vocab_size=data_vocab, max_seq_len=2048)
    fields.update(given)
    fields.setdefault("d_mlp", 4 * fields["d_model"])
    return GPTConfig(**fields)


class LayerNorm(nn.Module):
    """LayerNorm computed in float32, returned in the input's dtype."""

    cfg: GPTConfig
    hooks: Hooks

    @nn.compact
    def __call__(self, x_BxTxD):
        D, h = self.cfg.d_model, self.hooks
        scale = h.weight(layers.param(self, "scale", (D,), ("embed",), nn.initializers.ones),
                         ("embed",), jnp.float32)
        bias = h.weight(layers.param(self, "bias", (D,), ("embed",), nn.initializers.zeros),
                        ("embed",), jnp.float32)
        return layers.layer_norm(x_BxTxD, scale, bias, self.cfg.ln_eps)


class Block(nn.Module):
    """One pre-LayerNorm transformer block (block.pre_norm); scanned over
    `layers` by GPT.

    Matrices are used through `hooks.dense`, biases are added in float32 (so
    their gradients are reduced in float32), and every activation the
    backward pass needs is named for the remat policy.
    """

    cfg: GPTConfig
    hooks: Hooks

    @nn.compact
    def __call__(self, x_BxTxD, segments_BxT):
        c, h = self.cfg, self.hooks
        D, H, Q, F = c.d_model, c.n_head, c.head_dim, c.d_mlp
        normal = nn.initializers.normal(0.02)
        # GPT-2 scales the init of the projections into the residual stream.
        residual = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))
        param = functools.partial(layers.param, self)

        def dense(eq, x, name, shape, names, init):  # the block's projections: FP8 where asked
            return layers.projection(self, h, eq, x, name, shape, names, init)

        def add_bias(x, name, shape, names):
            return block.add_bias(h, param, x, name, shape, names)

        def attention(y):
            # Fused q/k/v (column-parallel over heads), output row-parallel.
            # There is no key bias: it adds q . b_k to every score of a row, which the
            # softmax cancels, so its gradient is zero and Adam would only amplify
            # rounding noise in it. (GPT-2's key bias is dropped exactly on import.)
            qkv_BxTx3xHxQ = dense("btd,dchq->btchq", y, "w_qkv", (D, 3, H, Q),
                                  ("embed", None, "heads", "kv"), normal)
            q = add_bias(qkv_BxTx3xHxQ[:, :, 0], "b_q", (H, Q), ("heads", "kv"))
            k = qkv_BxTx3xHxQ[:, :, 1]
            v = add_bias(qkv_BxTx3xHxQ[:, :, 2], "b_v", (H, Q), ("heads", "kv"))
            q, k, v = (h.act(t, ("batch", "seq", "heads", "kv"), name="qkv") for t in (q, k, v))
            att_BxTxHxQ = block.attend(h, q, k, v, segments_BxT)
            out_BxTxD = dense("bthq,hqd->btd", att_BxTxHxQ, "w_o", (H, Q, D),
                              ("heads", "kv", "embed"), residual)
            return add_bias(out_BxTxD, "b_o", (D,), ("embed",))

        def mlp(y):
            # Column-parallel in, row-parallel out.
            fc_BxTxF = dense("btd,df->btf", y, "w_fc", (D, F), ("embed", "mlp"), normal)
            fc_BxTxF = h.act(add_bias(fc_BxTxF, "b_fc", (F,), ("mlp",)), ("batch", "seq", "mlp"),
                             name="mlp_hidden")
            hid_BxTxF = h.act(layers.gelu(fc_BxTxF), ("batch", "seq", "mlp"), name="mlp_act")
            out_BxTxD = dense("btf,fd->btd", hid_BxTxF, "w_proj", (F, D), ("mlp", "embed"),
                              residual)
            return add_bias(out_BxTxD, "b_proj", (D,), ("embed",)), None

        return block.pre_norm(h, x_BxTxD, LayerNorm(c, h, name="ln_1"), attention,
                              LayerNorm(c, h, name="ln_2"), mlp)


def stack(cfg, hooks: Hooks) -> nn.Module:
    """The scanned stack of cfg.n_layer blocks (a pipeline stage uses fewer)."""
    return decoder.scanned(Block, cfg, hooks)


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V). `embed`, `stack` and `head` are
    separate methods so that a pipeline can place them on different stages."""

    cfg: GPTConfig
    hooks: Hooks = Hooks()

    def setup(self):
        c = self.cfg
        # Under a pipeline each stage may hold a block of a table's rows
        # (Hooks.rows); the lookups and the logits then use the block.
        table = self.hooks.table_shape
        self.wte = layers.param(self, "wte", table((c.padded_vocab, c.d_model), ("vocab", "embed")),
                                ("vocab", "embed"), nn.initializers.normal(0.02))
        self.wpe = layers.param(self, "wpe", table((c.max_seq_len, c.d_model), ("pos", "embed")),
                                ("pos", "embed"), nn.initializers.normal(0.01))
        self.blocks = stack(c, self.hooks)
        self.ln_f = LayerNorm(c, self.hooks)

    def embed(self, tokens_BxT, wte=None, segments_BxT=None):
        """`wte`: the table from `hooks.gathered`, when the head shares it;
        with `segments_BxT`, positions restart at each document."""
        T = tokens_BxT.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the position table "
                             f"(max_seq_len={self.cfg.max_seq_len})")
        h = self.hooks
        # Look up with the whole sequence first: with the vocabulary split over
        # `tensor`, each device reads its rows and the partial sums are reduced;
        # only then is the residual stream split along the sequence (under
        # sequence parallelism), rather than the table being gathered.
        tokens = h.lookup(self.wte if wte is None else wte, tokens_BxT, ("vocab", "embed"))
        # Positions are added in float32: their gradient is a sum over the
        # batch, and each device's part of it must reach the reduction across
        # devices in float32, not rounded to the compute dtype first.
        at = h.positions(T, segments_BxT)  # laid out over `context` (hooks.positions)
        if at is None:
            at = jnp.arange(T) if segments_BxT is None else layers.positions(segments_BxT)
        positions = h.lookup(self.wpe, at, ("pos", "embed"), out_dtype=jnp.float32)
        x_BxTxD = h.act((tokens.astype(jnp.float32) + positions).astype(h.dtype),
                        ("batch", "seq", "embed"))
        return h.act(x_BxTxD, ("batch", "res_seq", "embed"))

    def stack(self, x_BxTxD, segments_BxT=None):
        x_BxTxD, _ = self.blocks(x_BxTxD, segments_BxT)
        return x_BxTxD

    def head(self, x_BxTxD, wte=None):
        h = self.hooks
        y = h.act(self.ln_f(x_BxTxD), ("batch", "seq", "embed"))
        wte = self.wte if wte is None else wte
        logits_BxTxV = h.act(h.dense("btd,vd->btv", y, wte, ("vocab", "embed")),
                             ("batch", "seq", "vocab"))
        if self.cfg.padded_vocab != self.cfg.vocab_size:
            real_V = h.vocab_ids(logits_BxTxV.shape[-1]) < self.cfg.vocab_size
            logits_BxTxV = jnp.where(real_V, logits_BxTxV, jnp.finfo(logits_BxTxV.dtype).min)
        return logits_BxTxV

    def __call__(self, tokens_BxT, segments_BxT=None):
        # The tied table is gathered once (ZeRO-3) for the lookup and the head,
        # and its two gradients are summed before their one reduction.
        wte = self.hooks.gathered(self.wte, ("vocab", "embed"))
        x_BxTxD = self.embed(tokens_BxT, wte, segments_BxT)
        return self.head(self.stack(x_BxTxD, segments_BxT), wte)


def model_fns(cfg: GPTConfig) -> ModelFns:
    """The GPT as the zero_jax train step sees it."""
    return ModelFns(**decoder.fns(GPT, Block, cfg), vocab_size=cfg.vocab_size,
                    max_seq_len=cfg.max_seq_len, layers=cfg.n_layer, flops_per_token=cfg.flops_per_token,
                    block_ops=cfg.block_ops,
                    activation_bytes=cfg.activation_bytes, config=cfg, gathered_once=("wte",),
                    head_cost=cfg.head_cost)
