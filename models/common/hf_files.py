"""A Hugging Face model directory, whichever family's: config.json and the
weights, in `model.safetensors` or in `model-0000k-of-0000n.safetensors`
files with `model.safetensors.index.json` mapping each tensor to its file.
Read one tensor at a time (`Tensors`, and `load`: into the job's sharded
layout), written as `save_pretrained` writes (`save`: files of at most 5 GB
with an index). What each tensor is called, how it maps to our parameters
and what config.json says are the family's (models/gpt/hf.py,
models/llama/hf.py); models/__init__.py picks the family.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from zero_jax.checkpoint import export
from zero_jax.checkpoint import stream

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"

Get = Callable[[str], np.ndarray]  # Hugging Face tensor by name
Read = Callable[[str, int | None], np.ndarray]  # (our path, layer or None) -> array
# (Hugging Face name, shape, producer) of one tensor, as a family's `pieces` yields it
Piece = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists() and (
        (path / SINGLE).exists() or (path / INDEX).exists())


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{path}: no config.json (a Hugging Face model directory has one)")
    return json.loads(file.read_text())


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


def padded_rows(table: np.ndarray, rows: int) -> np.ndarray:
    """`table` with zero rows appended up to `rows` (the padded vocabulary);
    itself where none are needed, so that no copy is made."""
    if table.shape[0] == rows:
        return table
    return np.concatenate([table, np.zeros((rows - table.shape[0],) + table.shape[1:], table.dtype)])


def expert_pieces(read: Read, paths: Iterable[str], names: Iterable[str], layer: int | None,
                  prefix: str, shapes: Iterable[tuple[int, int]], n_experts: int
                  ) -> Iterable[Piece]:
    """Each expert's matrices as torch Linear weights (out, in), one by one:
    `names` (with "{j}", under `prefix`) from one `layer` (None: unstacked)
    of our stacked (E, in, out) parameters `paths`. Each parameter is read
    once, at its first expert, and let go after its last."""
    for path, name, shape in zip(paths, names, shapes):
        one = _OneLayer(read, path, layer, n_experts)
        for j in range(n_experts):
            yield (f"{prefix}.{name.format(j=j)}", shape,
                   lambda one=one, j=j: np.ascontiguousarray(one.expert(j).T))


class _OneLayer:
    """One layer of a stacked experts' parameter, read once for its first
    expert and let go after its last (written in order)."""

    def __init__(self, read: Read, path: str, layer: int | None, experts: int):
        self.read, self.path, self.layer, self.last = read, path, layer, experts - 1
        self.value = None

    def expert(self, j: int) -> np.ndarray:
        if self.value is None:
            self.value = self.read(self.path, self.layer)
        out = self.value[j]
        if j == self.last:
            self.value = None
        return out


def same(a, b) -> bool:
    """A config.json value and a model field agree (floats to 1e-9, lists as tuples)."""
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-9 * max(abs(float(a)), abs(float(b)), 1.0)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return tuple(a or ()) == tuple(b or ())
    return a == b


def load(path: Path, job, sources: dict[str, Callable[[Get, int | None], np.ndarray]],
         family: str) -> Any:
    """The job's master parameters (its layout's saved form, layer order)
    from the directory, placed one tensor at a time: each is read, converted
    to our layout by `sources` (the family's: transposes, head splits) and
    put into its sharded place before the next is read
    (zero_jax/checkpoint/stream.py)."""
    tensors = Tensors(path)
    try:
        return stream.place(job.state_plan.targets.params, job.state_plan.names,
                            lambda leaf, layer: sources[leaf](tensors.get, layer))
    except KeyError as e:
        raise ValueError(f"{path}: tensor {e.args[0]!r} is not in the weights, which "
                         f"config.json's {family} shape needs") from None


def save(out: Path, pieces: Iterable[Piece], config: Callable[[], dict],
         max_shard_bytes: int = MAX_SHARD_BYTES, dtype: str = "float32") -> list[Path]:
    """Write a Hugging Face directory: the tensors of `pieces` (a family's,
    which may refuse at the first one, before anything is written), in
    files of at most `max_shard_bytes` (a tensor larger than that gets a
    file of its own) with an index when there is more than one, each tensor
    produced and written before the next is read, in `dtype` (float32,
    bfloat16 or float16, cast as it is written); then `config()` as
    config.json. Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    items = list(pieces)
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
    (out / "config.json").write_text(json.dumps(config(), indent=1))
    return written
