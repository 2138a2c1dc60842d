"""Collectives in compiled HLO text: which ones, how many, in what dtype,
over which mesh axes, and in the forward or the backward pass.

Tests and reports read the optimised HLO (`compiled.as_text()`) to check
that a layout compiles to the communication it promises.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import os
import re
import tempfile
from pathlib import Path

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

OPS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

# `%name = <type> <op>(` where <type> may be a tuple with spaces in it; async
# pairs appear as `<op>-start` (counted) and `<op>-done` (not counted).
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s"
                   r"(?P<op>" + "|".join(OPS) + r")(?:-start)?\(")
_DTYPE = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*)\[")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # one of OPS
    dtypes: tuple[str, ...]  # element types in the result type
    line: str  # the HLO instruction, for messages

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.line)
        return m.group(1) if m else ""

    @property
    def backward(self) -> bool:
        """Part of the backward pass (a transposed, i.e. differentiated, op)."""
        return "transpose(" in self.op_name

    @property
    def shape(self) -> tuple[int, ...]:
        """The result's dimensions (the first array of a tuple result)."""
        dims = re.search(r"= \(?\w+\[([\d,]*)\]", self.line).group(1)
        return tuple(int(d) for d in dims.split(",") if d)

    def groups(self) -> list[list[int]]:
        """The device groups it runs over, as positions in the mesh's device order."""
        return replica_groups(self.line)

    def axes(self, mesh) -> tuple[str, ...] | None:
        """The mesh axes whose devices form its groups (None: no axis set matches)."""
        return axes_of(self.groups(), mesh)


def collectives(hlo_text: str) -> list[Collective]:
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if m:
            out.append(Collective(m["op"], tuple(_DTYPE.findall(m["type"])), line.strip()))
    return out


def counts(hlo_text: str) -> dict[str, int]:
    """Number of instructions of each collective op (0 for absent ones)."""
    found = collections.Counter(c.op for c in collectives(hlo_text))
    return {op: found.get(op, 0) for op in OPS}


_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DOT = re.compile(r"=\s*(\S+)\s+dot\(([^)]*)\)")


def gemms(hlo_text: str) -> dict[str, int]:
    """Matrix products in a compiled program's text, by kind: cuBLASLt's FP8
    GEMMs (the custom call XLA:GPU rewrites a quantise-dequantise product
    into), its other GEMM custom calls, Triton GEMM fusions, and plain dots
    (what other backends keep) with FP8 operands or without. Instructions,
    not executions: a loop body's count once."""
    found = collections.Counter()
    for line in hlo_text.splitlines():
        target = _TARGET.search(line)
        if target and ("cublas" in target[1] or "gemm" in target[1]):
            found["cublas_fp8" if "f8" in target[1] else "cublas_other"] += 1
        elif "__triton_gemm" in line and " fusion(" in line:
            found["triton_gemm"] += 1
        elif (dot := _DOT.search(line)) is not None:
            found["dot_fp8" if "f8e" in dot[2] else "dot"] += 1
    return {k: found.get(k, 0) for k in ("cublas_fp8", "cublas_other", "triton_gemm", "dot_fp8", "dot")}


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def replica_groups(line: str) -> list[list[int]]:
    """Parse the three forms XLA prints: explicit `{{0,1},{2,3}}`, iota
    `[4,2]<=[8]` or `[2,4]<=[4,2]T(1,0)`, and `mesh['a'=4,'b'=2] {'a'}`
    (optionally with `device_ids=([4,2]T(1,0))`)."""
    if "source_target_pairs=" in line:  # collective-permute: each pair is a group
        pairs = re.search(r"source_target_pairs=\{((?:\{[\d,]+\},?)*)\}", line).group(1)
        return [_ints(p) for p in re.findall(r"\{([\d,]+)\}", pairs)]
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = _ints(m.group(1))
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                  r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
    if m:
        named = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, dims = [n for n, _ in named], [int(d) for _, d in named]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
               if m.group(2) else np.arange(int(np.prod(dims))))
        ids = ids.reshape(dims)
        along = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        rest = [i for i in range(len(dims)) if i not in along]
        return ids.transpose(rest + along).reshape(-1, int(np.prod([dims[i] for i in along]))).tolist()
    return []


def axes_of(groups: list[list[int]], mesh) -> tuple[str, ...] | None:
    """The set of mesh axes whose device groups are exactly `groups`."""
    if not groups:
        return None
    target = {frozenset(g) for g in groups}
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    names = [n for n, size in mesh.shape.items() if size > 1]
    for k in range(1, len(names) + 1):
        for combo in itertools.combinations(names, k):
            along = [list(mesh.axis_names).index(a) for a in combo]
            rest = [i for i in range(ids.ndim) if i not in along]
            size = int(np.prod([ids.shape[i] for i in along]))
            found = {frozenset(g) for g in ids.transpose(rest + along).reshape(-1, size).tolist()}
            if found == target:
                return combo
    return None


def partitioned_text(lowered) -> str:
    """HLO of `lowered` right after SPMD partitioning, before backend passes.

    XLA:CPU has no bf16 collectives: its float-normalization pass widens a
    bf16 all-gather to f32 after partitioning, while GPU and TPU compilers
    keep it. What the program asks for (gather the bf16 copy) is visible
    here, on every platform.
    """
    return compile_partitioned(lowered)[1]


def compile_partitioned(lowered, **compiler_options):
    """(compiled executable, its HLO right after SPMD partitioning).

    The text comes from a compile that dumps it. The persistent compilation
    cache ignores dump options, so a hit there would skip that compile and
    write nothing: that compile runs with the cache off. With the cache on,
    the text is kept beside it under a hash of the program and the options,
    so a later compile of the same program reads the text and compiles as
    usual (a cache hit from then on).
    """
    key = _text_key(lowered, compiler_options)
    if key is not None and key.exists():
        return lowered.compile(compiler_options=compiler_options or None), key.read_text()
    compiled, text = _dump_compile(lowered, compiler_options)
    if key is not None:
        partial = key.with_suffix(f".tmp{os.getpid()}")
        partial.write_text(text)
        partial.replace(key)  # atomic: a reader sees all of it or nothing
    return compiled, text


def _dump_compile(lowered, compiler_options):
    cached = jax.config.jax_enable_compilation_cache
    # JAX decides whether to use its cache once per process: reset around this.
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        with tempfile.TemporaryDirectory() as out:
            compiled = lowered.compile(compiler_options={
                **compiler_options, "xla_dump_to": out, "xla_dump_hlo_pass_re": "spmd-partitioning"})
            found = sorted(Path(out).glob("*after_spmd-partitioning*.txt"))
            if found:
                return compiled, found[-1].read_text()
            if _one_device(compiled):
                # One device: nothing to partition, and XLA skips the pass.
                return compiled, lowered.as_text(dialect="hlo")
            raise RuntimeError("XLA wrote no post-partitioning HLO dump")
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        compilation_cache.reset_cache()


def _one_device(compiled) -> bool:
    shardings = jax.tree.leaves(compiled.input_shardings)
    return all(len(s.device_set) == 1 for s in shardings)


def _text_key(lowered, options) -> Path | None:
    directory = jax.config.jax_compilation_cache_dir
    if not (jax.config.jax_enable_compilation_cache and directory):
        return None
    devices = jax.devices()
    digest = hashlib.sha256("\n".join([
        lowered.as_text(), repr(sorted(options.items())), jax.__version__,
        devices[0].platform, devices[0].device_kind, str(len(devices)),
        os.environ.get("XLA_FLAGS", "")]).encode()).hexdigest()
    return Path(directory) / f"zero_jax-partitioned-{digest}.txt"


# Attributes by which an instruction calls another computation.
_CALLS = ("body", "condition", "to_apply", "calls", "branch_computations",
          "true_computation", "false_computation")


def callees(line: str, keys: tuple[str, ...] = _CALLS) -> list[str]:
    found = []
    for key in keys:
        for m in re.finditer(key + r"=\{?([%\w.\-, ]+)\}?", line):
            found += [n.strip().lstrip("%") for n in m.group(1).split(",")]
    return found


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: instruction lines} and the entry computation's name."""
    bodies: dict[str, list[str]] = {}
    name, entry = None, None
    for line in hlo_text.splitlines():
        head = line.split(" ", 2)
        if line and not line.startswith(" ") and line.rstrip().endswith("{") and len(head) > 1:
            name = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
            entry = name if head[0] == "ENTRY" else entry
            bodies[name] = []
        elif name is not None and line.startswith(" "):
            bodies[name].append(line)
    return bodies, entry
