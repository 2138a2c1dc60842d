"""The GPT in Hugging Face's GPT-2 layout: names, shapes and config.json.

Hugging Face stores each layer separately, with Conv1D weights as
(in, out) matrices: c_attn is (D, 3D) with q, k, v side by side, which is our
(D, 3, H, Q) reshaped. Our model has no key bias (the softmax cancels it), so
export writes zeros there and import drops it: the logits are the same.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from models.common.hf_files import Get, Read, padded_rows
from models.gpt.model import GPTConfig


def config_json(cfg: GPTConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_mlp,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.ln_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "tie_word_embeddings": True,
    }


def pieces(cfg: GPTConfig, read: Read) -> Iterator[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(Hugging Face name, shape, producer) for every tensor, one layer at a time."""
    D, F, V = cfg.d_model, cfg.d_mlp, cfg.vocab_size
    yield "wte.weight", (V, D), lambda: read("wte", None)[:V]
    yield "wpe.weight", (cfg.max_seq_len, D), lambda: read("wpe", None)
    for i in range(cfg.n_layer):
        def qkv_bias(i=i):
            q, v = read("blocks.b_q", i).reshape(D), read("blocks.b_v", i).reshape(D)
            return np.concatenate([q, np.zeros_like(q), v])
        layer = {
            "ln_1.weight": ((D,), lambda i=i: read("blocks.ln_1.scale", i)),
            "ln_1.bias": ((D,), lambda i=i: read("blocks.ln_1.bias", i)),
            "attn.c_attn.weight": ((D, 3 * D), lambda i=i: read("blocks.w_qkv", i).reshape(D, 3 * D)),
            "attn.c_attn.bias": ((3 * D,), qkv_bias),
            "attn.c_proj.weight": ((D, D), lambda i=i: read("blocks.w_o", i).reshape(D, D)),
            "attn.c_proj.bias": ((D,), lambda i=i: read("blocks.b_o", i)),
            "ln_2.weight": ((D,), lambda i=i: read("blocks.ln_2.scale", i)),
            "ln_2.bias": ((D,), lambda i=i: read("blocks.ln_2.bias", i)),
            "mlp.c_fc.weight": ((D, F), lambda i=i: read("blocks.w_fc", i)),
            "mlp.c_fc.bias": ((F,), lambda i=i: read("blocks.b_fc", i)),
            "mlp.c_proj.weight": ((F, D), lambda i=i: read("blocks.w_proj", i)),
            "mlp.c_proj.bias": ((D,), lambda i=i: read("blocks.b_proj", i)),
        }
        for name, (shape, produce) in layer.items():
            yield f"h.{i}.{name}", shape, produce
    yield "ln_f.weight", (D,), lambda: read("ln_f.scale", None)
    yield "ln_f.bias", (D,), lambda: read("ln_f.bias", None)


# GPT-2's keys that change what transformers computes, and the values this
# model computes: attention scaled by 1 / sqrt(head size) and not also by
# 1 / layer, GELU's tanh approximation (three names for one function), and
# the head tied to the embedding. Dropouts, and `reorder_and_upcast_attn`
# (where float16 rounds), leave float32 logits as they are.
FIXED = {"scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
         "activation_function": ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"),
         "tie_word_embeddings": (True,)}


def shape_from(hf: dict, where: str = "config.json") -> dict:
    """Our shape fields from a GPT-2 config.json; a key GPT2LMHeadModel
    honours at a value this model does not compute (FIXED) is refused,
    naming it."""
    for key, values in FIXED.items():
        if hf.get(key, values[0]) not in values:
            raise ValueError(f"{where}: {key} = {hf[key]!r} is not supported: this GPT computes "
                             f"{' / '.join(repr(v) for v in values)}")
    d = hf["n_embd"]
    return {"n_layer": hf["n_layer"], "n_head": hf["n_head"], "d_model": d,
            "d_mlp": hf.get("n_inner") or 4 * d, "vocab_size": hf["vocab_size"],
            "max_seq_len": hf["n_positions"],
            "ln_eps": float(hf.get("layer_norm_epsilon", 1e-5))}


def sources(cfg: GPTConfig) -> dict[str, Callable[[Get, int | None], np.ndarray]]:
    """Our parameter path -> how to build it, or one layer of it, from
    Hugging Face tensors: one tensor read per call."""
    D, H, Q = cfg.d_model, cfg.n_head, cfg.head_dim

    def get(tensors: Get, name: str) -> np.ndarray:
        # In the file's dtype: placing casts (checkpoint/stream.py).
        try:  # GPT2LMHeadModel prefixes "transformer."; GPT2Model does not
            return np.asarray(tensors("transformer." + name))
        except KeyError:
            return np.asarray(tensors(name))

    def layer(name, fn=lambda x: x):
        return lambda tensors, i: fn(get(tensors, f"h.{i}.{name}"))

    def wte(tensors, _):
        w = get(tensors, "wte.weight")
        if w.shape != (cfg.vocab_size, D):
            raise ValueError(f"wte.weight is {w.shape}; the model expects ({cfg.vocab_size}, {D})")
        return padded_rows(w, cfg.padded_vocab)

    return {
        "wte": wte, "wpe": lambda tensors, _: get(tensors, "wpe.weight"),
        "blocks.ln_1.scale": layer("ln_1.weight"), "blocks.ln_1.bias": layer("ln_1.bias"),
        # c_attn is (D, 3D), q, k, v side by side; the key bias is dropped (see above)
        "blocks.w_qkv": layer("attn.c_attn.weight", lambda w: w.reshape(D, 3, H, Q)),
        "blocks.b_q": layer("attn.c_attn.bias", lambda b: b[:D].reshape(H, Q)),
        "blocks.b_v": layer("attn.c_attn.bias", lambda b: b[2 * D:].reshape(H, Q)),
        "blocks.w_o": layer("attn.c_proj.weight", lambda w: w.reshape(H, Q, D)),
        "blocks.b_o": layer("attn.c_proj.bias"),
        "blocks.ln_2.scale": layer("ln_2.weight"), "blocks.ln_2.bias": layer("ln_2.bias"),
        "blocks.w_fc": layer("mlp.c_fc.weight"), "blocks.b_fc": layer("mlp.c_fc.bias"),
        "blocks.w_proj": layer("mlp.c_proj.weight"), "blocks.b_proj": layer("mlp.c_proj.bias"),
        "ln_f.scale": lambda tensors, _: get(tensors, "ln_f.weight"),
        "ln_f.bias": lambda tensors, _: get(tensors, "ln_f.bias"),
    }
