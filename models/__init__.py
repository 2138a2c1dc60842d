"""Reference models for zero_jax, one folder per family: the GPT (models/gpt/)
and the Llama family (models/llama/: Llama 2 and 3, Mistral, Qwen2, and the
mixtures of experts Mixtral, Qwen3-MoE, DeepSeek-V3 and Kimi-K2), over what both share
(models/common/). Each names logical axes only. A model is chosen by preset
name, or by "hf:DIR" for the shape in a Hugging Face directory's
config.json; shape fields override it. A Hugging Face directory is read and
written by models/common/hf_files.py, through the mapping (gpt/hf.py,
llama/hf.py) of the family its config.json names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from zero_jax.model.contract import ModelFns

from models import gpt, llama
from models.common import decoder, hf_files
from zero_jax.checkpoint import export, weights
from zero_jax.model import lora as lora_lib
from zero_jax.sharding.specs import named_leaves

GPT_FIELDS = ("n_layer", "n_head", "d_model", "d_mlp", "vocab_size", "max_seq_len")


def _resolve(name: str, overrides: dict) -> tuple[str, str, dict]:
    """(family, preset, fields) for a model name: a preset's, or "hf:DIR"'s
    shape with `overrides` on top; checks the fields belong to the family."""
    given = decoder.given(overrides)
    if name.startswith("hf:"):
        family, fields = hf_shape(Path(name[3:]))
        return family, "", {**fields, **given}
    if name in llama.presets.PRESETS:
        return "llama", name, given
    if name and name not in gpt.model.PRESETS:
        raise ValueError(f"--model {name!r}: no such preset; choose from "
                         f"{', '.join(gpt.model.PRESETS)}, {', '.join(llama.presets.PRESETS)}, "
                         "hf:DIR (a Hugging Face config.json), or "
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
        return gpt.model.config(preset, data_vocab, vocab_multiple=vocab_multiple, **fields)
    if preset:
        return llama.model.config(preset, data_vocab, vocab_multiple=vocab_multiple, **fields)
    fields.setdefault("vocab_size", data_vocab)
    return llama.model.LlamaConfig(vocab_multiple=vocab_multiple, **fields)


def model_fns(cfg) -> ModelFns:
    if isinstance(cfg, llama.model.LlamaConfig):
        return llama.model.model_fns(cfg)
    return gpt.model.model_fns(cfg)


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
    if isinstance(c, llama.model.LlamaConfig):
        mlp = f"mlp {c.d_mlp}"
        if c.n_experts:
            shared = f" + {c.n_shared_experts} shared" if c.n_shared_experts else ""
            mode = (f"capacity factor {c.capacity_factor:g}" if c.capacity_factor else "dropless")
            groups = f" from the best {c.topk_group} of {c.n_group} groups" if c.n_group > 1 else ""
            scores = " by sigmoid scores" if c.score_func == "sigmoid" else ""
            mlp = (f"{c.n_experts} experts of {c.expert_mlp}{shared}, top-{c.n_experts_per_tok}"
                   f"{groups}{scores} "
                   f"({mode}; {c.active_param_count:,} of {c.param_count:,} parameters active)")
        attention = (f"{c.n_head} heads over {c.n_kv_head} kv heads of {c.q_dim}" if not c.mla
                     else f"latent attention ({c.n_head} heads of q/k {c.q_dim} and v "
                          f"{c.v_dim}, kv rank {c.kv_lora_rank}, q rank {c.q_lora_rank or 'full'})")
        if c.first_k_dense_replace:
            mlp = f"the first {c.first_k_dense_replace} with an mlp of {c.d_mlp}, then {mlp}"
        if c.mtp_depth:
            mlp += f", MTP depth {c.mtp_depth} weighted {c.mtp_loss_weight:g}"
        return (f"{head}: {c.family} family, {c.n_layer} layers, d_model {c.d_model}, "
                f"{attention}, {mlp}, "
                f"vocab {vocab}{', tied head' if c.tie_embeddings else ''}, rope theta "
                f"{c.rope_theta:g}")
    return (f"{head}: {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
            f"mlp {c.d_mlp}, vocab {vocab}, positions {c.max_seq_len}")


def preset_vocab(name: str) -> int:
    """The vocabulary a preset names (0: the data's)."""
    if name in gpt.model.PRESETS:
        return gpt.model.PRESETS[name][4]
    if name in llama.presets.PRESETS:
        return llama.presets.PRESETS[name]["vocab_size"]
    if name.startswith("hf:"):
        return hf_shape(Path(name[3:]))[1].get("vocab_size", 0)
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
                           f"tokenizer; prepare it with the model's own (zero-jax prepare-data "
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
        for key in ("rope_scaling", "rope_yarn"):  # JSON lists, tuples in the config
            fields[key] = tuple(fields.get(key) or ())
        return llama.model.LlamaConfig(**fields)
    return gpt.model.GPTConfig(**fields)


def hf_export_config(recorded: dict, with_mtp: bool = False):
    """The model shape a Hugging Face export of a checkpoint writes (its
    meta "model" entry): the multi-token prediction modules only where
    asked (`with_mtp`), as transformers neither reads nor writes them."""
    cfg = config_from(recorded)
    depth = getattr(cfg, "mtp_depth", 0)
    if with_mtp and not depth:
        raise ValueError("--with-mtp: the checkpoint's model has no multi-token prediction "
                         "module (mtp_depth 0) to write; leave the flag out")
    return cfg if with_mtp or not depth else dataclasses.replace(cfg, mtp_depth=0)


def weight_dirs(name: str, init_from: str) -> list[str]:
    """Directories a run's model comes from (hf:DIR, --init-from DIR), whose
    tokenizer.json the data must have been prepared with."""
    dirs = [name[3:]] if name.startswith("hf:") else []
    return dirs + ([init_from] if init_from and Path(init_from).is_dir() else [])


def hf_shape(path: Path) -> tuple[str, dict]:
    """(family, shape fields) from a Hugging Face directory's config.json."""
    found = hf_files.read_config(path)
    kind, where = found.get("model_type"), str(path / "config.json")
    if kind == "gpt2":
        return "gpt", gpt.hf.shape_from(found, where=where)
    if kind in llama.hf.MODEL_TYPES:
        return "llama", llama.hf.shape_from(found, where=where)
    raise ValueError(f"{path}/config.json: model_type {kind!r} is not supported; supported: "
                     f"gpt2, {', '.join(llama.hf.MODEL_TYPES)}")


def _hf_mapping(cfg):
    """The Hugging Face mapping (names, shapes, config.json) of cfg's family."""
    return llama.hf if isinstance(cfg, llama.model.LlamaConfig) else gpt.hf


def _check_hf_matches(path: Path, cfg, model_name: str) -> str:
    """The family of the weights in `path`, whose config.json must give the
    model shape `cfg` (read before anything compiles: the weights are loaded
    only after)."""
    family, fields = hf_shape(path)
    mine = dataclasses.asdict(cfg)
    # Rotary embeddings have no table: a Llama-family model may be run at
    # another length than its config's max_position_embeddings.
    # The router's loss weights and capacity are training choices, not shape.
    free = ("max_seq_len", "router_aux_loss_coef", "router_z_loss_coef",
            "capacity_factor", "router_bias_update_rate", "mtp_depth",
            "mtp_loss_weight") if family == "llama" else ()
    differ = {k: (v, mine[k]) for k, v in fields.items()
              if k in mine and k not in free and not hf_files.same(v, mine[k])}
    if (family == "llama") != isinstance(cfg, llama.model.LlamaConfig) or differ:
        what = ", ".join(f"{k} {a} there, {b} in the model" for k, (a, b) in differ.items()) \
            or f"a {family} model there, not a {type(cfg).__name__}"
        named = model_name.startswith("hf:") and Path(model_name[3:]).resolve() == path.resolve()
        fix = ("leave out the shape flags that change it" if named
               else f"use --model hf:{path} to take the shape from it")
        if "vocab_size" in differ:
            fix = (f"the weights' vocabulary is their tokenizer's: prepare the data with it "
                   f"(zero-jax prepare-data --tokenizer {path}) and leave --vocab-size unset")
        raise ValueError(f"{path}/config.json does not match the model ({model_name}): "
                         f"{what}; {fix}")
    return family


def check_init_from(init_from: str, job) -> None:
    """A Hugging Face --init-from directory's config.json gives the job's
    model shape: checked before compiling, as the weights load only after."""
    if init_from and hf_files.is_hf_dir(Path(init_from)):
        _check_hf_matches(Path(init_from), job.model.config, job.run.model.name)
        hf_files.Tensors(Path(init_from))  # reads each file's header: a damaged one is named now


def hf_loader(source: str, job) -> dict | None:
    """Parameters from a Hugging Face directory, placed in the job's layout
    one tensor at a time (hf_files.load), or None if `source` is not one."""
    path = Path(source)
    if not hf_files.is_hf_dir(path):
        return None
    cfg = job.model.config
    family = _check_hf_matches(path, cfg, job.run.model.name)
    return hf_files.load(path, job, _hf_mapping(cfg).sources(cfg), family)


def hf_config_json(cfg, dtype: str = "float32", token_ids: dict | None = None) -> dict:
    """config.json for `cfg`, saying the weights' dtype (`torch_dtype`:
    what `from_pretrained(torch_dtype="auto")` loads them as) and the
    special tokens' ids in `token_ids` (tokenizer_files.Export). An id not
    known is written as null rather than left to the architecture's default
    (GPT-2's 50256, Llama's 1 and 2), which names another token or none:
    `generate` would not stop at the end of a document. GPT-2 begins text
    with its end-of-text token, so its bos is its eos."""
    is_llama = isinstance(cfg, llama.model.LlamaConfig)
    out = _hf_mapping(cfg).config_json(cfg)
    ids = {"bos_token_id": None, "eos_token_id": None, **(token_ids or {})}
    if not is_llama and "bos_token_id" not in (token_ids or {}):
        ids["bos_token_id"] = ids["eos_token_id"]
    return {**out, **ids, "torch_dtype": dtype}


def save_hf(out: Path, cfg, read: hf_files.Read, max_shard_bytes: int = hf_files.MAX_SHARD_BYTES,
            dtype: str = "float32", token_ids: dict | None = None) -> list[Path]:
    """Write `cfg`'s Hugging Face directory (hf_files.save): its family's
    tensors, `read(path, layer)` giving our parameters, in `dtype`, and
    config.json (hf_config_json, naming `token_ids`). Returns the files
    written."""
    return hf_files.save(out, _hf_mapping(cfg).pieces(cfg, read),
                       lambda: hf_config_json(cfg, dtype, token_ids), max_shard_bytes, dtype)


def save_peft(out: Path, meta: dict, arrays: dict, read: hf_files.Read,
              dtype: str = "float32") -> list[Path]:
    """A LoRA checkpoint's adapters (`arrays`: its manifest, path -> shape;
    `read(path, layer)`) as peft's directory for the checkpoint's model
    (`meta`), written in `dtype`. Returns the files written."""
    cfg = config_from(meta["model"])
    if not isinstance(cfg, llama.model.LlamaConfig) or cfg.mla or cfg.n_experts:
        raise ValueError(f"--peft-dir: adapters of {meta['model']['name']} have no peft layout "
                         "here; the Llama family's dense models' do")
    shapes = {path: tuple(a["shape"]) for path, a in arrays.items()
              if "_lora." in path}  # peft holds the adapters (not an FP8 run's amax histories)
    lora, base = meta["run"]["lora"], meta.get("lora_base", {})
    weights = sorted({path.split(".")[-2].removesuffix("_lora") for path in shapes})
    out.mkdir(parents=True, exist_ok=True)
    export.write_safetensors(out / llama.peft.WEIGHTS, [
        (name, shape, dtype, produce)
        for name, shape, produce in llama.peft.pieces(cfg.n_layer, shapes, read)],
        {"format": "pt"})
    config = llama.peft.config_json(lora["rank"], lora["alpha"], weights,
                                    base.get("init_from") or meta["model"]["name"],
                                    lora.get("dropout", 0.0))
    (out / llama.peft.CONFIG).write_text(json.dumps(config, indent=1))
    return [out / llama.peft.WEIGHTS, out / llama.peft.CONFIG]


def peft_loader(source: str, job) -> dict | None:
    """A peft adapter directory's LoRA adapters, placed in the job's layout
    (its parameters, under LoRA the adapters), or None if `source` is not
    one. Its adapter_config.json must give the job's rank, alpha and
    targets: one line names what differs."""
    path = Path(source)
    if not (path / llama.peft.CONFIG).is_file():
        return None
    found, lora, cfg = json.loads((path / llama.peft.CONFIG).read_text()), job.run.lora, \
        job.model.config
    targets = sorted(llama.peft.MODULES[lora_lib.TARGETS[t]].split(".")[-1]
                     for t in lora_lib.parse_targets(lora.targets))
    want = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": targets,
            "use_rslora": False, "bias": "none", "fan_in_fan_out": False}
    have = {**{k: found.get(k) for k in want},
            "target_modules": sorted(found.get("target_modules") or [])}
    differ = [f"{k} {have[k]} there, {want[k]} here" for k in want if have[k] != want[k]]
    if differ:
        raise ValueError(f"{path / llama.peft.CONFIG}: {'; '.join(differ)}: give the adapters' "
                         "--lora-rank, --lora-alpha and --lora-targets")
    shapes = {p: tuple(a.shape) for p, a in named_leaves(job.state_plan.master_params).items()}
    tensors = export.SafetensorsFile(path / llama.peft.WEIGHTS)
    flat = llama.peft.adapters(cfg.n_layer, shapes, tensors.get)
    tree: dict = {}
    for p, x in flat.items():  # dotted paths -> the nested parameter tree
        *parents, leaf = p.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = x
    return weights.place(tree, job)
