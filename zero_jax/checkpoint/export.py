"""Consolidated weights from a sharded checkpoint, streamed array by array.

`ParamReader` reads parameters straight from a checkpoint's storage, one
array, or one layer of a stacked array, at a time, so host memory stays near
the largest piece rather than the model. `write_safetensors` writes the
safetensors format (an 8-byte header length, a JSON header, then the raw
little-endian data) while the pieces are produced, never holding two at once.
Scanned stacks are written one tensor per layer (`blocks.3.w_fc`), which is
what other frameworks expect and what keeps the pieces small.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import tensorstore as ts

from zero_jax.checkpoint import integrity
from zero_jax.checkpoint.manager import CorruptCheckpoint, read_meta
from zero_jax.sharding.specs import is_spec, path_name

# numpy dtype name -> safetensors dtype
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
           "int32": "I32", "int64": "I64", "int16": "I16", "int8": "I8", "uint8": "U8",
           "bool": "BOOL"}

_NAMES = {code: name for name, code in _DTYPES.items()}  # safetensors dtype -> numpy name
FLOATING = ("float16", "bfloat16", "float32", "float64")  # (ml_dtypes' bfloat16 is no np.floating)

# A piece of the output: name, shape, dtype name, and how to produce its data.
Piece = tuple[str, tuple[int, ...], str, Callable[[], np.ndarray]]


class ParamReader:
    """The parameters of one checkpoint step, read from storage on demand.

    Every piece read is added to its array's running checksum; when the last
    piece of an array has been read, the sum is compared with the one saved,
    so an export verifies what it writes without holding whole arrays.
    """

    def __init__(self, step_dir: str | Path):
        self.step_dir = Path(step_dir)
        meta = read_meta(self.step_dir)
        self.meta = meta
        self.arrays = meta["manifest"]["params"]  # path -> {shape, dtype, checksum}
        self.logical = meta.get("logical_axes", {})  # path -> logical names
        self._sums: dict[str, tuple[integrity.RunningChecksum, set]] = {}
        # One context for every read: no cache, one chunk decoded at a time, so
        # what is held is the piece being read, not a pool of them.
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                                    "data_copy_concurrency": {"limit": 1},
                                    "file_io_concurrency": {"limit": 1}})

    def _open(self, path: str):
        # A file:// URL takes an absolute path: "file://ckpt/3" would name a host "ckpt".
        base = (self.step_dir / "params").absolute()
        spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{base}",
                                              "path": path}}
        return ts.open(spec, read=True, context=self._context).result()

    def read(self, path: str, layer: int | None = None) -> np.ndarray:
        """The array at `path`, or its slice `layer` along the first dimension."""
        if path not in self.arrays:
            raise KeyError(f"{self.step_dir}: no parameter {path!r}")
        store = self._open(path)
        if layer is not None:
            store = store[layer]
        data = _read_by_chunk(store)
        self._check(path, layer, data)
        return data

    def _check(self, path: str, layer: int | None, data: np.ndarray) -> None:
        running, seen = self._sums.setdefault(path, (integrity.RunningChecksum(), set()))
        if layer in seen:
            return  # read twice: counted once
        seen.add(layer)
        running.add(data, 0 if layer is None else layer * data.size)
        pieces = 1 if layer is None else self.arrays[path]["shape"][0]
        if len(seen) == pieces and running.value != self.arrays[path]["checksum"]:
            raise CorruptCheckpoint(self.step_dir.parent, int(self.step_dir.name),
                                    f"checksum mismatch in params.{path}")

    def layers(self, path: str) -> int | None:
        """Number of layers if the array is a scanned stack, else None."""
        names = self.logical.get(path)
        return self.arrays[path]["shape"][0] if names and names[0] == "layers" else None

    def consolidated(self, dtype: str | None = None) -> Iterator[Piece]:
        """Every parameter, stacked ones split per layer (`blocks.w_fc` -> `blocks.3.w_fc`),
        in its stored dtype or, floating ones, in `dtype` (cast as each piece is written)."""
        for path, info in self.arrays.items():
            n, written = self.layers(path), _written_dtype(info["dtype"], dtype)
            if n is None:
                yield path, tuple(info["shape"]), written, (lambda p=path: self.read(p))
                continue
            head, _, leaf = path.rpartition(".")
            for i in range(n):
                name = f"{head}.{i}.{leaf}" if head else f"{i}.{leaf}"
                yield name, tuple(info["shape"][1:]), written, (lambda p=path, i=i: self.read(p, i))

    def stored_dtypes(self) -> set[str]:
        """The dtypes the parameters are stored in (the run's parameter dtype)."""
        return {info["dtype"] for info in self.arrays.values()}

    def largest_piece_bytes(self) -> int:
        return max(int(np.prod(shape)) * np.dtype(_np_dtype(dtype)).itemsize
                   for _, shape, dtype, _ in self.consolidated())

    def total_bytes(self) -> int:
        return sum(int(np.prod(a["shape"])) * np.dtype(_np_dtype(a["dtype"])).itemsize
                   for a in self.arrays.values())


def _read_by_chunk(store) -> np.ndarray:
    """Read `store` one storage chunk at a time into one output array.

    A single read of a region spanning many chunks buffers all of them
    besides the output; chunk by chunk, what is held is the output and one
    chunk.
    """
    out = np.empty(store.shape, dtype=store.dtype.numpy_dtype)
    chunk = store.chunk_layout.read_chunk.shape
    origin = store.domain.origin
    grid = [range(0, n, c) for n, c in zip(store.shape, chunk)]
    for corner in np.ndindex(*(len(g) for g in grid)):
        local = tuple(slice(g[i], min(g[i] + c, n))
                      for i, g, c, n in zip(corner, grid, chunk, store.shape))
        shifted = tuple(slice(o + sl.start, o + sl.stop) for o, sl in zip(origin, local))
        out[local] = store[shifted].read().result()
    return out


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them per thread arena)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


def _written_dtype(stored: str, asked: str | None) -> str:
    """`asked` for a floating parameter, else the stored dtype (integers keep theirs)."""
    return asked if asked and stored in FLOATING else stored


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def write_safetensors(path: str | Path, pieces: Iterable[Piece],
                      metadata: dict[str, str] | None = None) -> int:
    """Write `pieces` to a safetensors file, one at a time; returns bytes written."""
    assert sys.byteorder == "little", "safetensors data is little-endian"
    pieces = list(pieces)
    header: dict[str, object] = {"__metadata__": metadata or {}}
    offset = 0
    for name, shape, dtype, _ in pieces:
        if dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {dtype} has no safetensors code")
        size = int(np.prod(shape)) * np.dtype(_np_dtype(dtype)).itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, dtype, produce in pieces:
            data = _cast(name, produce(), dtype)
            if data.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {data.shape}, expected {tuple(shape)}")
            f.write(data.reshape(-1).view(np.uint8).data)  # no copy of the data
            del data
            _release_freed_memory()
    return 8 + len(text) + offset


class OutOfRange(ValueError):
    """A parameter with finite values that the dtype asked for cannot hold."""


def _cast(name: str, data: np.ndarray, dtype: str) -> np.ndarray:
    """`data` in `dtype`. A narrowing cast rounds, which is asked for; a
    finite value that would become infinite (float16 holds nothing above
    65504) is refused: the file would hold a model that is not the one trained."""
    with np.errstate(over="ignore"):  # an overflow is found below, and named
        out = np.ascontiguousarray(data, dtype=_np_dtype(dtype))
    if out.dtype == data.dtype or dtype not in FLOATING:
        return out
    infinite = np.count_nonzero(np.isinf(out))  # the source is read again only if any
    if infinite and infinite > np.count_nonzero(np.isinf(data)):
        largest = float(np.max(np.abs(data[np.isfinite(data)])))
        raise OutOfRange(f"{name}: values up to {largest:.4g} do not fit in {dtype}, whose "
                         f"largest is {float(_finfo(dtype).max):.4g}; export in float32 "
                         "(or bfloat16, float32's range)")
    return out


def _finfo(dtype: str):
    """finfo of a floating dtype by name, bfloat16 included."""
    import ml_dtypes
    return ml_dtypes.finfo(_np_dtype(dtype))


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file; the message names it."""


def read_header(path: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file: an 8-byte little-endian
    length, then that many bytes of a JSON object."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors file "
                                   "(8 bytes of header length come first); the file is cut "
                                   "short or not safetensors")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise SafetensorsError(f"{path}: the header claims {length:,} bytes but the file "
                                   f"has {size:,}; the file is cut short or not safetensors")
        text = f.read(length)
    try:
        header = json.loads(text)
    except ValueError as e:
        where = f" ({e.msg} at byte {8 + e.pos:,})" if isinstance(e, json.JSONDecodeError) else ""
        raise SafetensorsError(f"{path}: the safetensors header is not valid JSON{where}; "
                               "the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the safetensors header is JSON but not an object of "
                               "tensors; the file is damaged or not safetensors")
    return length, header


class SafetensorsFile:
    """The tensors of one safetensors file, each read straight from the file
    into its own array on demand: no memory map, so reading a tensor adds
    that tensor's bytes to the process and nothing more."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        length, header = read_header(self.path)
        header.pop("__metadata__", None)
        self.start = 8 + length
        self.header = header  # name -> {dtype, shape, data_offsets}

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's dtype as numpy names it (`bfloat16` for BF16)."""
        return _NAMES[self.header[name]["dtype"]]

    def get(self, name: str) -> np.ndarray:
        entry = self.header[name]
        dtype = _np_dtype(self.dtype(name))
        begin, end = entry["data_offsets"]
        count = (end - begin) // np.dtype(dtype).itemsize
        data = np.fromfile(self.path, dtype=dtype, count=count, offset=self.start + begin)
        return data.reshape(entry["shape"])


def read_consolidated(path: str | Path, names: Any) -> Any:
    """A consolidated .safetensors file -> parameter tree (numpy), restacking layers.

    `names` is the model's tree of logical names; a parameter whose first
    logical axis is `layers` is read from its per-layer tensors. Tensors keep
    the file's dtype (BF16 as ml_dtypes' bfloat16, which jax loads): placing
    them casts (run.place).
    """
    import jax
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        keys = set(f.keys())

        def leaf(p, spec):
            name = path_name(p)
            if len(spec) and spec[0] == "layers":
                head, _, tail = name.rpartition(".")
                per_layer = sorted((int(k[len(head) + 1:].split(".")[0]), k) for k in keys
                                   if k.startswith(f"{head}.") and k.endswith(f".{tail}")
                                   and k[len(head) + 1:].split(".")[0].isdigit())
                if not per_layer:
                    raise KeyError(f"{path}: no per-layer tensors {head}.<i>.{tail}")
                return np.stack([f.get_tensor(k) for _, k in per_layer])
            if name not in keys:
                raise KeyError(f"{path}: no tensor {name!r}")
            return f.get_tensor(name)

        return jax.tree_util.tree_map_with_path(leaf, names, is_leaf=is_spec)
