"""The GPT in Hugging Face's GPT-2 layout: names, shapes and config.json.

Hugging Face stores each layer separately, with Conv1D weights as
(in, out) matrices: c_attn is (D, 3D) with q, k, v side by side, which is our
(D, 3, H, Q) reshaped. Our model has no key bias (the softmax cancels it), so
export writes zeros there and import drops it: the logits are the same.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from models.gpt import GPTConfig

Read = Callable[[str, int | None], np.ndarray]  # (our path, layer or None) -> array


def config_json(cfg: GPTConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_mlp,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.ln_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "tie_word_embeddings": True, "torch_dtype": "float32",
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


def params_from(cfg: GPTConfig, tensors: Callable[[str], np.ndarray]) -> dict:
    """Our parameter tree (numpy, stacked layers) from Hugging Face tensors by name."""
    D, H, Q, L = cfg.d_model, cfg.n_head, cfg.head_dim, cfg.n_layer

    def get(name):
        for prefix in ("", "transformer."):
            try:
                return np.asarray(tensors(prefix + name), np.float32)
            except KeyError:
                continue
        raise KeyError(f"tensor {name!r} not in the Hugging Face weights")

    def stack(name, fn=lambda x: x):
        return np.stack([fn(get(f"h.{i}.{name}")) for i in range(L)])

    wte = get("wte.weight")
    if wte.shape != (cfg.vocab_size, D):
        raise ValueError(f"wte.weight is {wte.shape}; the model expects ({cfg.vocab_size}, {D})")
    wte = np.concatenate([wte, np.zeros((cfg.padded_vocab - cfg.vocab_size, D), np.float32)])
    c_attn_b = stack("attn.c_attn.bias")  # (L, 3D): q, k (dropped), v
    return {
        "wte": wte, "wpe": get("wpe.weight"),
        "blocks": {
            "ln_1": {"scale": stack("ln_1.weight"), "bias": stack("ln_1.bias")},
            "w_qkv": stack("attn.c_attn.weight", lambda w: w.reshape(D, 3, H, Q)),
            "b_q": c_attn_b[:, :D].reshape(L, H, Q), "b_v": c_attn_b[:, 2 * D:].reshape(L, H, Q),
            "w_o": stack("attn.c_proj.weight", lambda w: w.reshape(H, Q, D)),
            "b_o": stack("attn.c_proj.bias"),
            "ln_2": {"scale": stack("ln_2.weight"), "bias": stack("ln_2.bias")},
            "w_fc": stack("mlp.c_fc.weight"), "b_fc": stack("mlp.c_fc.bias"),
            "w_proj": stack("mlp.c_proj.weight"), "b_proj": stack("mlp.c_proj.bias"),
        },
        "ln_f": {"scale": get("ln_f.weight"), "bias": get("ln_f.bias")},
    }
