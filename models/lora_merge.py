"""A LoRA checkpoint's adapters merged into its base's weights, read one
array (one layer of a stacked one) at a time: what `zero-jax export
--merge-lora` writes in Hugging Face's layout.

The base is read again from where its checkpoint says it came from (its
meta's `lora_base`: a Hugging Face directory or a full run's checkpoint),
and first checked against the digest recorded there, computed here on the
host as on the devices (zero_jax/checkpoint/weights.py `digest`, the same
layout-independent sums: integrity.RunningChecksum), after the same cast
to the dtype the run used it in. A base whose files changed since is
refused, never merged into.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from models import llama
from models.common import hf_files
from zero_jax.checkpoint import export, integrity
from zero_jax.checkpoint import manager as manager_lib


def base_reader(meta: dict, cfg) -> tuple[Callable, list[str]]:
    """(read(path, layer) of the base's parameters, their paths), from the
    source a LoRA checkpoint's meta names."""
    source = (meta.get("lora_base") or {}).get("init_from")
    if not source:
        seed = (meta.get("lora_base") or {}).get("seed")
        raise ValueError(f"--merge-lora: the adapters were trained on the initialisation of "
                         f"seed {seed}, which no file holds to merge into; train on a base "
                         "given with --init-from, or export the adapters with --peft-dir")
    path = Path(source)
    if hf_files.is_hf_dir(path):
        tensors, sources = hf_files.Tensors(path), llama.hf.sources(cfg)
        return (lambda p, layer: sources[p](tensors.get, layer)), sorted(sources)
    steps = manager_lib.complete_steps(path) if path.is_dir() else []
    if not steps:
        raise ValueError(f"--merge-lora: the base {source} is not a Hugging Face directory or "
                         "a checkpoint (any more); merging needs its weights there")
    reader = export.ParamReader(path / str(steps[-1]))
    return reader.read, sorted(reader.arrays)


def check_digest(meta: dict, cfg, read: Callable, paths: list[str]) -> None:
    """The base read as the run read it has the digest its checkpoint records."""
    dtype = np.dtype(jnp.dtype(meta["precision"]["compute"]))  # the base's (state.py)
    sums = {}
    for p in paths:
        running, offset = integrity.RunningChecksum(), 0
        for layer in _layers(cfg, p):
            piece = np.asarray(read(p, layer)).astype(dtype)
            running.add(piece, offset)
            offset += piece.size
        sums[p] = running.value
    found = hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()
    saved = meta["lora_base"]["digest"]
    if found != saved:
        raise ValueError(f"--merge-lora: the base at {meta['lora_base']['init_from']} has other "
                         f"weights than the adapters were trained on (digest {found[:12]}, "
                         f"saved {saved[:12]}); merge into the base they were trained on")


def _layers(cfg, path: str) -> list[int | None]:
    """How a parameter is read: layer by layer (a layer stack), or whole."""
    return list(range(cfg.n_layer)) if path.startswith("blocks.") else [None]


def merged(meta: dict, cfg, read_adapter: Callable) -> Callable:
    """read(path, layer) of the base's weights with each adapted one's
    (alpha / rank) A B added, in float64; the base checked first."""
    read_base, paths = base_reader(meta, cfg)
    check_digest(meta, cfg, read_base, paths)
    lora = meta["run"]["lora"]
    scale = lora["alpha"] / lora["rank"]
    adapted = {p.removesuffix("_lora.a") for p in meta["manifest"]["params"] if p.endswith("_lora.a")}

    trained = set(meta["manifest"]["params"])  # the adapters and the statistics kept with them

    def read(path: str, layer: int | None) -> np.ndarray:
        if path in trained:  # a selection bias the run moved: the checkpoint's
            return np.asarray(read_adapter(path, layer))
        w = np.asarray(read_base(path, layer))
        if path not in adapted:
            return w
        a, b = read_adapter(f"{path}_lora.a", layer), read_adapter(f"{path}_lora.b", layer)
        # In float64, so the merged weight is rounded once, when written.
        delta = np.tensordot(a.astype(np.float64), b.astype(np.float64), axes=([-1], [0]))
        if delta.shape != w.shape or math.prod(a.shape[:-1]) * math.prod(b.shape[1:]) != w.size:
            raise ValueError(f"--merge-lora: {path}'s adapters make {delta.shape}, the weight is "
                             f"{w.shape}")
        return w.astype(np.float64) + scale * delta
    return read
