"""Reference models for zero_jax. Each names logical axes only."""

from __future__ import annotations

import json
from pathlib import Path

from zero_jax.model import ModelFns

from models import gpt, gpt_hf


def build(name: str, data_vocab: int, vocab_multiple: int = 1, **overrides) -> ModelFns:
    """A model by preset name, sized to the data's vocabulary unless the preset
    or `overrides` name one (`overrides` change any shape field, e.g. n_layer)."""
    return gpt.model_fns(gpt.config(name, data_vocab, vocab_multiple=vocab_multiple, **overrides))


def builder(name: str, data_vocab: int, **overrides):
    """`vocab_multiple -> ModelFns`, checking the name now."""
    gpt.config(name, data_vocab, **overrides)
    return lambda vocab_multiple: build(name, data_vocab, vocab_multiple, **overrides)


def describe(name: str, data_vocab: int, vocab_multiple: int = 1, **overrides) -> str:
    c = gpt.config(name, data_vocab, vocab_multiple=vocab_multiple, **overrides)
    vocab = f"{c.vocab_size}" + (f" padded to {c.padded_vocab}" if c.padded_vocab != c.vocab_size else "")
    changed = [k for k, v in overrides.items() if v]
    return (f"{name or 'custom'}{' with ' + ', '.join(changed) + ' set' if name and changed else ''}: "
            f"{c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
            f"mlp {c.d_mlp}, vocab {vocab}, positions {c.max_seq_len}")


def preset_vocab(name: str) -> int:
    """The vocabulary a preset names (0: the data's)."""
    return gpt.PRESETS[name][4] if name in gpt.PRESETS else 0


def for_run(model_cfg, data_vocab: int):
    """(builder, describe line) for a run's [model] table: its preset and
    shape fields, the data's vocabulary where neither names one. A model
    vocabulary smaller than the data's is an error."""
    shape = model_cfg.shape()
    cfg = gpt.config(model_cfg.name, data_vocab, **shape)
    if cfg.vocab_size < data_vocab:
        raise ValueError(f"the model's vocabulary ({cfg.vocab_size}, --vocab-size or the preset) "
                         f"is smaller than the data's ({data_vocab}): token ids would fall outside "
                         f"the embedding; use --vocab-size {data_vocab} or more")
    return (builder(model_cfg.name, data_vocab, **shape),
            describe(model_cfg.name, data_vocab, model_cfg.vocab_multiple, **shape))


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
