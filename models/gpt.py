"""GPT-2 style decoder in Flax: learned positions, pre-LayerNorm, GELU MLP,
tied embeddings, causal attention; the blocks are one scanned, stacked layer.

The model names logical axes only; `Hooks` (zero_jax.hooks) turn them into
sharding constraints. Tensor names carry their shapes: B batch, T sequence,
D model width, H heads, Q head size, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax.hooks import Hooks
from zero_jax.model import ModelFns


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model."""

    vocab_size: int  # tokens the data can produce
    n_layer: int  # transformer blocks (L)
    n_head: int  # attention heads (H)
    d_model: int  # residual width (D); head size Q = D / H
    d_mlp: int  # MLP hidden width (F), 4 D in GPT-2
    max_seq_len: int  # rows of the learned position table
    ln_eps: float = 1e-5  # LayerNorm epsilon, as GPT-2

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def param_count(self) -> int:
        D, F, L = self.d_model, self.d_mlp, self.n_layer
        block = 4 * D + (3 * D * D + 2 * D) + (D * D + D) + (D * F + F) + (F * D + D)
        return self.vocab_size * D + self.max_seq_len * D + L * block + 2 * D

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6 N + 12 L H Q T (PaLM, appendix B).

        N counts the non-embedding matmul parameters plus the tied output
        projection; the attention term is the full T x T product (not halved
        for the causal mask), as PaLM and the MFU figures it is compared with.
        """
        D, F, L = self.d_model, self.d_mlp, self.n_layer
        n_matmul = L * (4 * D * D + 2 * D * F) + self.vocab_size * D
        return 6 * n_matmul + 12 * L * self.n_head * self.head_dim * seq_len


# name -> (n_layer, n_head, d_model, max_seq_len); d_mlp = 4 d_model.
PRESETS: dict[str, tuple[int, int, int, int]] = {
    "gpt-tiny": (4, 6, 192, 256),
    "gpt-small": (12, 12, 768, 1024),
    "gpt-medium": (24, 16, 1024, 1024),
    "gpt-large": (36, 20, 1280, 1024),
    "gpt-xl": (48, 25, 1600, 1024),
    "gpt-7b": (32, 32, 4096, 2048),
}


def config(name: str, vocab_size: int, **overrides) -> GPTConfig:
    """A preset's shape with the data's vocabulary (and any field overridden)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(PRESETS)}")
    n_layer, n_head, d_model, max_seq_len = PRESETS[name]
    fields = dict(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, d_model=d_model,
                  d_mlp=4 * d_model, max_seq_len=max_seq_len)
    return GPTConfig(**{**fields, **overrides})


def _param(module: nn.Module, name: str, shape, names, init):
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


class LayerNorm(nn.Module):
    cfg: GPTConfig
    hooks: Hooks

    @nn.compact
    def __call__(self, x_BxTxD):
        D = self.cfg.d_model
        scale = self.hooks.weight(_param(self, "scale", (D,), ("embed",), nn.initializers.ones), ("embed",))
        bias = self.hooks.weight(_param(self, "bias", (D,), ("embed",), nn.initializers.zeros), ("embed",))
        x = x_BxTxD.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.cfg.ln_eps) * scale + bias


class Block(nn.Module):
    """One pre-LayerNorm transformer block; scanned over `layers` by GPT."""

    cfg: GPTConfig
    hooks: Hooks

    @nn.compact
    def __call__(self, x_BxTxD, _):
        c, h = self.cfg, self.hooks
        D, H, Q, F = c.d_model, c.n_head, c.head_dim, c.d_mlp
        normal = nn.initializers.normal(0.02)
        # GPT-2 scales the init of the projections into the residual stream.
        residual = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))
        zeros = nn.initializers.zeros

        def weight(name, shape, names, init):
            return h.weight(_param(self, name, shape, names, init), names)

        x_BxTxD = h.act(x_BxTxD, ("batch", "res_seq", "embed"))

        # Attention: fused q/k/v (column-parallel over heads), output row-parallel.
        # There is no key bias: it adds q . b_k to every score of a row, which the
        # softmax cancels, so its gradient is zero and Adam would only amplify
        # rounding noise in it. (GPT-2's key bias is dropped exactly on import.)
        y = h.act(LayerNorm(c, h, name="ln_1")(x_BxTxD), ("batch", "seq", "embed"))
        w_qkv = weight("w_qkv", (D, 3, H, Q), ("embed", None, "heads", "kv"), normal)
        b_q = weight("b_q", (H, Q), ("heads", "kv"), zeros)
        b_v = weight("b_v", (H, Q), ("heads", "kv"), zeros)
        qkv_BxTx3xHxQ = jnp.einsum("btd,dchq->btchq", y, w_qkv)
        q, k, v = (h.act(qkv_BxTx3xHxQ[:, :, i] + b, ("batch", "seq", "heads", "kv"))
                   for i, b in enumerate((b_q, 0.0, b_v)))
        T = x_BxTxD.shape[1]
        scores_BxHxTxT = jnp.einsum("bthq,bshq->bhts", q, k) / math.sqrt(Q)
        causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores_BxHxTxT = jnp.where(causal_TxT, scores_BxHxTxT, jnp.finfo(scores_BxHxTxT.dtype).min)
        probs_BxHxTxT = jax.nn.softmax(scores_BxHxTxT.astype(jnp.float32), axis=-1).astype(v.dtype)
        att_BxTxHxQ = h.act(jnp.einsum("bhts,bshq->bthq", probs_BxHxTxT, v),
                            ("batch", "seq", "heads", "kv"))
        w_o = weight("w_o", (H, Q, D), ("heads", "kv", "embed"), residual)
        b_o = weight("b_o", (D,), ("embed",), zeros)
        x_BxTxD = x_BxTxD + h.act(jnp.einsum("bthq,hqd->btd", att_BxTxHxQ, w_o) + b_o,
                                  ("batch", "res_seq", "embed"))

        # MLP: column-parallel in, row-parallel out.
        y = h.act(LayerNorm(c, h, name="ln_2")(x_BxTxD), ("batch", "seq", "embed"))
        w_fc = weight("w_fc", (D, F), ("embed", "mlp"), normal)
        b_fc = weight("b_fc", (F,), ("mlp",), zeros)
        hid_BxTxF = h.act(jax.nn.gelu(y @ w_fc + b_fc, approximate=True), ("batch", "seq", "mlp"))
        w_proj = weight("w_proj", (F, D), ("mlp", "embed"), residual)
        b_proj = weight("b_proj", (D,), ("embed",), zeros)
        x_BxTxD = x_BxTxD + h.act(hid_BxTxF @ w_proj + b_proj, ("batch", "res_seq", "embed"))
        return x_BxTxD, None


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V). `embed`, `stack` and `head` are
    separate methods so that a pipeline can place them on different stages."""

    cfg: GPTConfig
    hooks: Hooks = Hooks()

    def setup(self):
        c = self.cfg
        self.wte = _param(self, "wte", (c.vocab_size, c.d_model), ("vocab", "embed"),
                          nn.initializers.normal(0.02))
        self.wpe = _param(self, "wpe", (c.max_seq_len, c.d_model), ("pos", "embed"),
                          nn.initializers.normal(0.01))
        self.blocks = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True},
            length=c.n_layer, metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, self.hooks)
        self.ln_f = LayerNorm(c, self.hooks)

    def embed(self, tokens_BxT):
        T = tokens_BxT.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the position table "
                             f"(max_seq_len={self.cfg.max_seq_len})")
        h = self.hooks
        wte = h.weight(self.wte, ("vocab", "embed"))
        wpe = h.weight(self.wpe, ("pos", "embed"))
        x_BxTxD = jnp.take(wte, tokens_BxT, axis=0)
        return h.act(x_BxTxD + wpe[:T], ("batch", "res_seq", "embed"))

    def stack(self, x_BxTxD):
        x_BxTxD, _ = self.blocks(x_BxTxD, None)
        return x_BxTxD

    def head(self, x_BxTxD):
        h = self.hooks
        y = h.act(self.ln_f(x_BxTxD), ("batch", "seq", "embed"))
        wte = h.weight(self.wte, ("vocab", "embed"))
        return h.act(jnp.einsum("btd,vd->btv", y, wte), ("batch", "seq", "vocab"))

    def __call__(self, tokens_BxT):
        return self.head(self.stack(self.embed(tokens_BxT)))


def model_fns(cfg: GPTConfig) -> ModelFns:
    """The GPT as the zero_jax train step sees it."""

    def init(key):
        tokens = jnp.zeros((1, min(8, cfg.max_seq_len)), jnp.int32)
        return GPT(cfg).init(key, tokens)["params"]

    def apply(params, tokens_BxT, hooks):
        return GPT(cfg, hooks).apply({"params": params}, tokens_BxT)

    def decay_mask(params):
        # Matrices (named w*) decay; LayerNorm parameters and biases do not.
        return jax.tree_util.tree_map_with_path(
            lambda path, _: str(path[-1].key).startswith("w"), params)

    return ModelFns(init=init, apply=apply, vocab_size=cfg.vocab_size,
                    flops_per_token=cfg.flops_per_token, decay_mask=decay_mask)
