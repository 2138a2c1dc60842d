"""Hugging Face directories: config.json <-> our model shapes, and weights in
(`load`: one tensor at a time into the job's sharded layout) and out
(`save`: 5 GB safetensors files with an index, as `save_pretrained` writes).

Architectures: GPT2LMHeadModel (models/gpt_hf.py), and LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM
and Qwen3MoeForCausalLM (models/llama_hf.py). A directory
holds `model.safetensors`, or `model-0000k-of-0000n.safetensors` files with
`model.safetensors.index.json` mapping each tensor to its file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from models import gpt_hf, llama, llama_hf
from zero_jax.checkpoint import export
from zero_jax.checkpoint import stream

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists() and (
        (path / SINGLE).exists() or (path / INDEX).exists())


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{path}: no config.json (a Hugging Face model directory has one)")
    return json.loads(file.read_text())


def shape(path: Path) -> tuple[str, dict]:
    """(family, shape fields) from a Hugging Face config.json."""
    hf = read_config(path)
    kind = hf.get("model_type")
    if kind == "gpt2":
        return "gpt", gpt_hf.shape_from(hf, where=str(path / "config.json"))
    if kind in llama_hf.MODEL_TYPES:
        return "llama", llama_hf.shape_from(hf, where=str(path / "config.json"))
    raise ValueError(f"{path}/config.json: model_type {kind!r} is not supported; supported: "
                     f"gpt2, {', '.join(llama_hf.MODEL_TYPES)}")


class Tensors:
    """The tensors of a directory by name, each read from its file on demand
    (zero_jax.checkpoint.export.SafetensorsFile: no memory map)."""

    def __init__(self, path: Path):
        self.path = path
        if (path / INDEX).exists():
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
            # Every file the index names is looked for before any is opened:
            # a download cut short is then one line naming what it lacks.
            missing = [name for name in names if not (path / name).is_file()]
            if missing:
                which = (f"{missing[0]}, which is" if len(missing) == 1 else
                         f"{', '.join(missing)} ({len(missing)} of its {len(names)} files), "
                         "which are")
                raise FileNotFoundError(f"{path / INDEX} names {which} missing from {path}: "
                                        "copy or download every file the index names")
            files = {name: export.SafetensorsFile(path / name) for name in names}
            self.files = {name: files[file] for name, file in weight_map.items()}
        else:
            single = export.SafetensorsFile(path / SINGLE)
            self.files = {name: single for name in single.keys()}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KeyError(name)
        return self.files[name].get(name)


def check_matches(path: Path, cfg, model_name: str) -> str:
    """The family of the weights in `path`, whose config.json must give the
    model shape `cfg` (read before anything compiles: the weights are loaded
    only after)."""
    family, fields = shape(path)
    mine = dataclasses.asdict(cfg)
    # Rotary embeddings have no table: a Llama-family model may be run at
    # another length than its config's max_position_embeddings.
    # The router's loss weights and capacity are training choices, not shape.
    free = ("max_seq_len", "router_aux_loss_coef", "router_z_loss_coef",
            "capacity_factor") if family == "llama" else ()
    differ = {k: (v, mine[k]) for k, v in fields.items()
              if k in mine and k not in free and not _same(v, mine[k])}
    if (family == "llama") != isinstance(cfg, llama.LlamaConfig) or differ:
        what = ", ".join(f"{k} {a} there, {b} in the model" for k, (a, b) in differ.items()) \
            or f"a {family} model there, not a {type(cfg).__name__}"
        named = model_name.startswith("hf:") and Path(model_name[3:]).resolve() == path.resolve()
        fix = ("leave out the shape flags that change it" if named
               else f"use --model hf:{path} to take the shape from it")
        if "vocab_size" in differ:
            fix = (f"the weights' vocabulary is their tokenizer's: prepare the data with it "
                   f"(scripts/prepare_data.py --tokenizer {path}) and leave --vocab-size unset")
        raise ValueError(f"{path}/config.json does not match the model ({model_name}): "
                         f"{what}; {fix}")
    return family


def load(path: Path, job) -> Any:
    """The job's master parameters (its layout's saved form, layer order)
    from a Hugging Face directory, placed one tensor at a time: each is read,
    converted to our layout (transposes, head splits) and put into its
    sharded place before the next is read (zero_jax/checkpoint/stream.py)."""
    cfg = job.model.config
    family = check_matches(path, cfg, job.run.model.name)
    tensors = Tensors(path)
    sources = llama_hf.sources(cfg) if family == "llama" else gpt_hf.sources(cfg)
    try:
        return stream.place(job.state_plan.targets.params, job.state_plan.names,
                            lambda leaf, layer: sources[leaf](tensors.get, layer))
    except KeyError as e:
        raise ValueError(f"{path}: tensor {e.args[0]!r} is not in the weights, which "
                         f"config.json's {family} shape needs") from None


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-9 * max(abs(float(a)), abs(float(b)), 1.0)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return tuple(a or ()) == tuple(b or ())
    return a == b


def pieces(cfg, read) -> Iterator[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(Hugging Face name, shape, producer) of every tensor, `read(path, layer)`
    giving our parameters."""
    if isinstance(cfg, llama.LlamaConfig):
        return llama_hf.pieces(cfg, read)
    return gpt_hf.pieces(cfg, read)


def config_json(cfg, dtype: str = "float32", token_ids: dict | None = None) -> dict:
    """config.json for `cfg`, saying the weights' dtype (`torch_dtype`:
    what `from_pretrained(torch_dtype="auto")` loads them as) and the
    special tokens' ids in `token_ids` (tokenizer_files.Export). An id not
    known is written as null rather than left to the architecture's default
    (GPT-2's 50256, Llama's 1 and 2), which names another token or none:
    `generate` would not stop at the end of a document. GPT-2 begins text
    with its end-of-text token, so its bos is its eos."""
    is_llama = isinstance(cfg, llama.LlamaConfig)
    out = llama_hf.config_json(cfg) if is_llama else gpt_hf.config_json(cfg)
    ids = {"bos_token_id": None, "eos_token_id": None, **(token_ids or {})}
    if not is_llama and "bos_token_id" not in (token_ids or {}):
        ids["bos_token_id"] = ids["eos_token_id"]
    return {**out, **ids, "torch_dtype": dtype}


def save(out: Path, cfg, read, max_shard_bytes: int = MAX_SHARD_BYTES,
         dtype: str = "float32", token_ids: dict | None = None) -> list[Path]:
    """Write a Hugging Face directory: config.json and the weights, in files
    of at most `max_shard_bytes` (a tensor larger than that gets a file of
    its own) with an index when there is more than one, each tensor produced
    and written before the next is read, in `dtype` (float32, bfloat16 or float16,
    cast as it is written); config.json names `token_ids` (config_json).
    Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    items = list(pieces(cfg, read))
    def size(shape):
        return int(np.prod(shape)) * np.dtype(dtype).itemsize
    groups: list[list] = [[]]
    for item in items:
        if groups[-1] and sum(size(s) for _, s, _ in groups[-1]) + size(item[1]) > max_shard_bytes:
            groups.append([])
        groups[-1].append(item)
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    written = []
    try:
        for name, group in zip(names, groups):
            written.append(out / name)
            export.write_safetensors(out / name, [(t, s, dtype, p) for t, s, p in group],
                                     {"format": "pt"})
    except BaseException:  # a shard cut short is no shard: leave none of this export's
        for path in written:
            path.unlink(missing_ok=True)
        raise
    if n > 1:
        index = {"metadata": {"total_size": sum(size(s) for _, s, _ in items)},
                 "weight_map": {t: name for name, group in zip(names, groups) for t, _, _ in group}}
        (out / INDEX).write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(config_json(cfg, dtype, token_ids), indent=1))
    return written

