"""Reference models for zero_jax, by family: the GPT (models/gpt.py) and the
Llama family (models/llama.py: Llama 2 and 3, Mistral, Qwen2, and the
mixtures of experts Mixtral and Qwen3-MoE, models/moe.py). Each names
logical axes only. A model is chosen by preset name, or by "hf:DIR" for the
shape in a Hugging Face directory's config.json; shape fields override it."""

from __future__ import annotations

from pathlib import Path

from zero_jax.model.contract import ModelFns

from models import decoder, gpt, hf, llama

GPT_FIELDS = ("n_layer", "n_head", "d_model", "d_mlp", "vocab_size", "max_seq_len")


def _resolve(name: str, overrides: dict) -> tuple[str, str, dict]:
    """(family, preset, fields) for a model name: a preset's, or "hf:DIR"'s
    shape with `overrides` on top; checks the fields belong to the family."""
    given = decoder.given(overrides)
    if name.startswith("hf:"):
        family, fields = hf.shape(Path(name[3:]))
        return family, "", {**fields, **given}
    if name in llama.PRESETS:
        return "llama", name, given
    if name and name not in gpt.PRESETS:
        raise ValueError(f"--model {name!r}: no such preset; choose from {', '.join(gpt.PRESETS)}, "
                         f"{', '.join(llama.PRESETS)}, hf:DIR (a Hugging Face config.json), or "
                         "give every shape (--model '' --n-layer .. --n-head .. --d-model ..)")
    other = sorted(set(given) - set(GPT_FIELDS))
    if other:
        raise ValueError(f"{', '.join(other)}: Llama-family fields, but {name or 'a custom GPT'} "
                         "is a GPT; choose a Llama-family preset (llama-tiny, llama-3-8b, ...)")
    return "gpt", name, given


def config(name: str, data_vocab: int, vocab_multiple: int = 1, **overrides):
    """The model's frozen shape dataclass."""
    family, preset, fields = _resolve(name, overrides)
    if family == "gpt":
        return gpt.config(preset, data_vocab, vocab_multiple=vocab_multiple, **fields)
    if preset:
        return llama.config(preset, data_vocab, vocab_multiple=vocab_multiple, **fields)
    fields.setdefault("vocab_size", data_vocab)
    return llama.LlamaConfig(vocab_multiple=vocab_multiple, **fields)


def model_fns(cfg) -> ModelFns:
    return llama.model_fns(cfg) if isinstance(cfg, llama.LlamaConfig) else gpt.model_fns(cfg)


def build(name: str, data_vocab: int, vocab_multiple: int = 1, **overrides) -> ModelFns:
    """A model by name, sized to the data's vocabulary unless the preset or
    `overrides` name one (`overrides` change any shape field, e.g. n_layer)."""
    return model_fns(config(name, data_vocab, vocab_multiple, **overrides))


def builder(name: str, data_vocab: int, **overrides):
    """`vocab_multiple -> ModelFns`, checking the name now."""
    config(name, data_vocab, **overrides)
    return lambda vocab_multiple: build(name, data_vocab, vocab_multiple, **overrides)


def describe(name: str, data_vocab: int, vocab_multiple: int = 1, **overrides) -> str:
    c = config(name, data_vocab, vocab_multiple, **overrides)
    vocab = f"{c.vocab_size}" + (f" padded to {c.padded_vocab}" if c.padded_vocab != c.vocab_size else "")
    changed = list(decoder.given(overrides))
    head = f"{name or 'custom'}{' with ' + ', '.join(changed) + ' set' if name and changed else ''}"
    if isinstance(c, llama.LlamaConfig):
        mlp = f"mlp {c.d_mlp}"
        if c.n_experts:
            shared = f" + {c.n_shared_experts} shared" if c.n_shared_experts else ""
            mode = (f"capacity factor {c.capacity_factor:g}" if c.capacity_factor else "dropless")
            mlp = (f"{c.n_experts} experts of {c.expert_mlp}{shared}, top-{c.n_experts_per_tok} "
                   f"({mode}; {c.active_param_count:,} of {c.param_count:,} parameters active)")
        return (f"{head}: {c.family} family, {c.n_layer} layers, d_model {c.d_model}, "
                f"{c.n_head} heads over {c.n_kv_head} kv heads of {c.q_dim}, {mlp}, "
                f"vocab {vocab}{', tied head' if c.tie_embeddings else ''}, rope theta "
                f"{c.rope_theta:g}")
    return (f"{head}: {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
            f"mlp {c.d_mlp}, vocab {vocab}, positions {c.max_seq_len}")


def preset_vocab(name: str) -> int:
    """The vocabulary a preset names (0: the data's)."""
    if name in gpt.PRESETS:
        return gpt.PRESETS[name][4]
    if name in llama.PRESETS:
        return llama.PRESETS[name]["vocab_size"]
    if name.startswith("hf:"):
        return hf.shape(Path(name[3:]))[1].get("vocab_size", 0)
    return 0


def for_run(model_cfg, data_vocab: int):
    """(builder, describe line) for a run's [model] table: its preset and
    shape fields, the data's vocabulary where neither names one. A model
    vocabulary smaller than the data's is an error."""
    shape = model_cfg.shape()
    cfg = config(model_cfg.name, data_vocab, **shape)
    if cfg.vocab_size < data_vocab:
        name = model_cfg.name
        if "vocab_size" in shape:
            source, fix = "--vocab-size", f"use --vocab-size {data_vocab} or more"
        elif name.startswith("hf:"):
            # The weights' embedding is their tokenizer's: data with larger ids
            # was made with another tokenizer, and no --vocab-size mends that.
            source, fix = (f"{name[3:]}/config.json", "the data was prepared with another "
                           f"tokenizer; prepare it with the model's own (scripts/prepare_data.py "
                           f"--tokenizer {name[3:]})")
        else:
            source, fix = (f"the preset {name}", "prepare the data with the preset's tokenizer, "
                           f"or give --vocab-size {data_vocab} or more to train from scratch")
        raise ValueError(f"the model's vocabulary ({cfg.vocab_size}, {source}) is smaller than "
                         f"the data's ({data_vocab}): token ids would fall outside the "
                         f"embedding; {fix}")
    return (builder(model_cfg.name, data_vocab, **shape),
            describe(model_cfg.name, data_vocab, model_cfg.vocab_multiple, **shape))


def config_from(recorded: dict):
    """The model shape a checkpoint recorded (its meta "model" entry)."""
    fields = {k: v for k, v in recorded.items() if k != "name"}
    if "n_kv_head" in fields:
        fields["rope_scaling"] = tuple(fields.get("rope_scaling") or ())
        return llama.LlamaConfig(**fields)
    return gpt.GPTConfig(**fields)


def weight_dirs(name: str, init_from: str) -> list[str]:
    """Directories a run's model comes from (hf:DIR, --init-from DIR), whose
    tokenizer.json the data must have been prepared with."""
    dirs = [name[3:]] if name.startswith("hf:") else []
    return dirs + ([init_from] if init_from and Path(init_from).is_dir() else [])


def check_init_from(init_from: str, job) -> None:
    """A Hugging Face --init-from directory's config.json gives the job's
    model shape: checked before compiling, as the weights load only after."""
    if init_from and hf.is_hf_dir(Path(init_from)):
        hf.check_matches(Path(init_from), job.model.config, job.run.model.name)
        hf.Tensors(Path(init_from))  # reads each file's header: a damaged one is named now


def hf_loader(source: str, job) -> dict | None:
    """Parameters from a Hugging Face directory, placed in the job's layout
    one tensor at a time (hf.py), or None if `source` is not one."""
    path = Path(source)
    if not hf.is_hf_dir(path):
        return None
    return hf.load(path, job)

