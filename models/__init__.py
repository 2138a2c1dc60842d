"""Reference models for zero_jax. Each names logical axes only."""

from __future__ import annotations

import json
from pathlib import Path

from zero_jax.model import ModelFns

from models import gpt, gpt_hf


def build(name: str, vocab_size: int, vocab_multiple: int = 1, **overrides) -> ModelFns:
    """A model by preset name, sized to the data's vocabulary (`overrides`
    change other shape fields, e.g. n_layer)."""
    return gpt.model_fns(gpt.config(name, vocab_size, vocab_multiple=vocab_multiple, **overrides))


def builder(name: str, vocab_size: int, **overrides):
    """`vocab_multiple -> ModelFns`, checking the name now."""
    gpt.config(name, vocab_size, **overrides)
    return lambda vocab_multiple: build(name, vocab_size, vocab_multiple, **overrides)


def describe(name: str, vocab_size: int, vocab_multiple: int = 1) -> str:
    c = gpt.config(name, vocab_size, vocab_multiple=vocab_multiple)
    vocab = f"{c.vocab_size}" + (f" padded to {c.padded_vocab}" if c.padded_vocab != c.vocab_size else "")
    return (f"{name}: {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
            f"mlp {c.d_mlp}, vocab {vocab}, positions {c.max_seq_len}")


def config_from(recorded: dict) -> gpt.GPTConfig:
    """The model shape a checkpoint recorded (its meta "model" entry)."""
    fields = {k: v for k, v in recorded.items() if k != "name"}
    return gpt.GPTConfig(**fields)


def hf_loader(source: str, job) -> dict | None:
    """Parameters from a Hugging Face GPT-2 directory (config.json + model.safetensors),
    or None if `source` is not one."""
    path = Path(source)
    if not (path.is_dir() and (path / "config.json").exists() and (path / "model.safetensors").exists()):
        return None
    from safetensors import safe_open

    hf = json.loads((path / "config.json").read_text())
    cfg = job.model.config
    mine = {"n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len}
    differ = {k: (hf.get(k), v) for k, v in mine.items() if hf.get(k) != v}
    if differ:
        raise ValueError(f"{source}: Hugging Face config differs from the model: "
                         + ", ".join(f"{k} {a} there, {b} here" for k, (a, b) in differ.items()))
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return gpt_hf.params_from(cfg, f.get_tensor)
