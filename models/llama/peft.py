"""LoRA adapters of the Llama family in peft's layout: adapter_config.json
and adapter_model.safetensors, which `peft.PeftModel.from_pretrained`
loads onto the transformers model (models/llama/hf.py) of the base.

Ours (zero_jax/model/lora.py) are A, W's input dimensions then the rank,
and B, the rank then W's output dimensions, stacked over layers; peft's
are torch Linear weights, lora_A (r, in features) and lora_B (out
features, r), with W's dimensions flattened in the order transformers'
Linear has them, which is ours (a head's rows together: hf.py). The scale
is the same, lora_alpha / r.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import numpy as np

from models.common.hf_files import Piece, Read

# Our projection -> the module transformers' Llama-family layer holds it as.
MODULES = {"w_q": "self_attn.q_proj", "w_k": "self_attn.k_proj", "w_v": "self_attn.v_proj",
           "w_o": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
           "w_down": "mlp.down_proj"}
PREFIX = "base_model.model.model.layers"  # peft's name of a causal LM's layers
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def config_json(rank: int, alpha: float, weights: list[str], base: str,
                dropout: float = 0.0) -> dict[str, Any]:
    """adapter_config.json for adapters of `rank` and `alpha` on our
    projections `weights`, trained with `dropout` (peft applies it in training only)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": sorted(MODULES[w].split(".")[-1] for w in weights),
            "lora_dropout": dropout, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base}


def factor(path: str, one: tuple[int, ...]) -> tuple[str, tuple[int, int], Callable, Callable]:
    """Of our adapter parameter `path` ("blocks.w_q_lora.a") of one layer's
    shape `one`: (peft's module and matrix name, its shape, ours -> theirs,
    theirs -> ours)."""
    weight, which = path.split(".")[-2].removesuffix("_lora"), path.split(".")[-1]
    if which == "a":  # (in..., r) <-> (r, in)
        return (f"{MODULES[weight]}.lora_A.weight", (one[-1], math.prod(one[:-1])),
                lambda x: x.reshape(-1, one[-1]).T, lambda w: w.T.reshape(one))
    return (f"{MODULES[weight]}.lora_B.weight", (math.prod(one[1:]), one[0]),  # (r, out...) <-> (out, r)
            lambda x: x.reshape(one[0], -1).T, lambda w: w.T.reshape(one))


def pieces(layers: int, shapes: dict[str, tuple[int, ...]], read: Read) -> Iterator[Piece]:
    """(peft's name, shape, producer) of every adapter matrix, layer by
    layer: `shapes` are our stacked adapters' ("blocks.w_q_lora.a": (L, D, r)),
    `read(path, layer)` one layer of one."""
    for i in range(layers):
        for path, shape in sorted(shapes.items()):
            name, theirs, to_theirs, _ = factor(path, tuple(shape[1:]))
            yield (f"{PREFIX}.{i}.{name}", theirs,
                   lambda path=path, i=i, f=to_theirs: np.ascontiguousarray(f(read(path, i))))


def adapters(layers: int, shapes: dict[str, tuple[int, ...]], get: Callable[[str], np.ndarray]
             ) -> dict[str, np.ndarray]:
    """Our stacked adapters {path: (L, ...)} from peft's tensors (`get` by name)."""
    out = {}
    for path, shape in shapes.items():
        name, _, _, to_ours = factor(path, tuple(shape[1:]))
        out[path] = np.stack([to_ours(np.asarray(get(f"{PREFIX}.{i}.{name}")))
                              for i in range(layers)])
    return out
