"""Collective bytes per device per optimizer step, read from compiled HLO.

The payload of a collective is the size of the array it produces, or, for a
reduce-scatter, of the array it consumes: what the ZeRO paper's volumes count
before the ring factor (an all-reduce of the gradients is Psi g bytes, its
ring traffic 2 (N - 1) / N of that). A collective inside a while loop (the
layer scan, the microbatch loop, the pipeline's ticks) runs once per
iteration, so it is multiplied by the trip counts of the loops around it.

XLA's CPU compiler forms no reduce-scatter from GSPMD: it emits an
all-reduce whose result is only dynamic-sliced down to this device's shard.
Such an all-reduce is counted as the reduce-scatter it stands for (same
payload, the consumed array); the result names it `reduce-scatter` and
`rewritten` says how many were.

A collective inside a conditional branch (a pipeline tick's forward or
backward) is counted every time the conditional runs, as if every branch
were taken: an upper bound, reported apart as `in_branches`.

A collective-permute is named by the mesh axes along which its source and
target devices differ.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zero_jax.analysis import hlo
from zero_jax.model import fp8
from zero_jax.precision import master
from zero_jax.sharding import quantized
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.mesh import DATA_AXES
from zero_jax.sharding.specs import shard_elements, spec_leaves

# 4-bit arrays (LoRA's nf4 codes) are packed two a byte.
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=")
# Instructions that only re-view an array on its way to a slice.
_VIEWS = ("bitcast", "reshape", "copy", "convert", "transpose")


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Payload bytes per device per step, by `op@axes` (e.g. `all-gather@fsdp`)."""

    by_op: dict[str, int]  # "op@axis,axis" -> bytes
    rewritten: int  # all-reduces counted as the reduce-scatter they stand for
    unknown_loops: int  # while loops whose trip count could not be read (counted once)
    in_branches: int = 0  # bytes of collectives inside conditional branches (in by_op too)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def over(self, axis: str) -> int:
        """Bytes of the collectives whose groups span `axis` (alone or with others)."""
        return sum(b for k, b in self.by_op.items() if axis in k.partition("@")[2].split(","))

    def of(self, op: str) -> int:
        return sum(b for k, b in self.by_op.items() if k.partition("@")[0] == op)


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
    """A step's collectives as the memory report shows them: measured in its
    HLO after SPMD partitioning, beside the ZeRO paper's volumes."""

    measured: Traffic  # the HLO after SPMD partitioning
    theory: dict[str, int] | None  # `theory` (None with a pipeline)
    after_backend_bytes: int | None = None  # the compiled program's total, where given

    def to_json(self) -> dict[str, Any]:
        notes = {"source": "HLO after SPMD partitioning (before backend passes)",
                 "reduce_scatters_from_all_reduce": self.measured.rewritten,
                 "bytes_in_conditional_branches": self.measured.in_branches,
                 "loops_of_unknown_trip_count": self.measured.unknown_loops}
        if self.after_backend_bytes is not None:
            notes["after_backend_passes_bytes"] = self.after_backend_bytes
        theory = None if self.theory is None else {**self.theory,
                                                    "total": sum(self.theory.values())}
        return {"collectives": self.measured.by_op, "collective_bytes": self.measured.total,
                "collective_theory": theory, "collective_notes": notes}


def array_bytes(type_text: str) -> list[float]:
    """Bytes of each array in an HLO type (a tuple lists several)."""
    return [math.prod(int(d) for d in dims.split(",") if d) * _dtype_bytes(dtype)
            for dtype, dims in _ARRAY.findall(type_text)]


def _dtype_bytes(dtype: str) -> float:
    return 1 if dtype.startswith("f8") else _BYTES[dtype]


def trip_count(while_line: str, bodies: dict[str, list[str]]) -> int | None:
    """Iterations of a while loop: XLA's annotation, else `i < N` in its condition
    (the form scans and fori_loops lower to, counting from 0)."""
    m = _TRIP.search(while_line)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", while_line)
    lines = bodies.get(cond.group(1), []) if cond else []
    if not any("direction=LT" in line for line in lines):
        return None
    limits = [int(c) for line in lines for c in re.findall(r"s32\[\] constant\((\d+)\)", line)]
    return limits[0] if len(limits) == 1 else None


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


def multiplicities(text: str, unknown_trips: int = 1) -> tuple[dict[str, int], set[str], int]:
    """How many times each computation runs per call of the entry; the
    computations reached through a conditional branch; and the number of
    loops whose trip count was unknown (counted as `unknown_trips`: one
    unless the caller knows how many times a data-dependent loop ran)."""
    bodies, entry = hlo.computations(text)
    times: dict[str, int] = collections.defaultdict(int)
    branched: set[str] = set()
    unknown = 0

    def visit(name: str, n: int, in_branch: bool) -> None:
        nonlocal unknown
        times[name] += n
        if in_branch:
            branched.add(name)
        for line in bodies.get(name, []):
            if " while(" in line:
                trips = trip_count(line, bodies)
                unknown += trips is None
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                visit(body, n * (unknown_trips if trips is None else trips or 1), in_branch)
                continue
            # `to_apply` names a reducer, except on a call (a shard_map body).
            keys = ("calls",) + _BRANCHES + (("to_apply",) if re.search(r"\scall\(", line) else ())
            for key in keys:
                for m in re.finditer(key + r"=\{?([%\w.\-, ]+)\}?", line):
                    for callee in m.group(1).split(","):
                        callee = callee.strip().lstrip("%")
                        if callee in bodies:
                            visit(callee, n, in_branch or key in _BRANCHES)

    if entry is not None:
        visit(entry, 1, False)
    return dict(times), branched, unknown


def _payload(c: hlo.Collective, type_text: str) -> int:
    arrays = array_bytes(type_text)
    if not arrays:
        return 0
    if "-start(" in c.line and c.op in ("all-gather", "collective-permute"):
        return arrays[1] if len(arrays) > 1 else arrays[0]  # (operand, result, ...)
    if c.op == "reduce-scatter":
        groups = c.groups()
        return sum(arrays) * (len(groups[0]) if groups else 1)
    return sum(arrays)


def _elements(type_text: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d)
               for _, dims in _ARRAY.findall(type_text))


def _stands_for_reduce_scatter(name: str, elements: int, group: int, lines: list[str]) -> bool:
    """An all-reduce whose every use, through views, is a slice to 1/group of it."""
    frontier, seen, slices = [name], {name}, 0
    while frontier:
        pattern = re.compile(re.escape(frontier.pop()) + r"(?![\w.\-])")
        for line in lines:
            m = _NAME.match(line)
            rhs = line.split("=", 1)[1] if m else ""
            if not m or not pattern.search(rhs.split("metadata=")[0]) or m.group(1) in seen:
                continue
            op = re.match(r"\s*(\(.*?\)|\S+)\s+([\w\-]+)\(", rhs)
            kind = op.group(2) if op else ""
            if kind in _VIEWS:
                seen.add(m.group(1))
                frontier.append(m.group(1))
            elif kind == "dynamic-slice" and _elements(op.group(1)) * group == elements:
                seen.add(m.group(1))
                slices += 1
            else:
                return False
    return slices > 0


def traffic(text: str, mesh) -> Traffic:
    """Collective payload bytes per device per step of the program `text`."""
    bodies, _ = hlo.computations(text)
    times, branched, unknown = multiplicities(text)
    out: dict[str, int] = collections.defaultdict(int)
    rewritten = in_branches = 0
    for name, lines in bodies.items():
        n = times.get(name, 0)
        if not n:
            continue
        for c in hlo.collectives("\n".join(lines)):
            type_text = hlo._LINE.match(c.line)["type"]
            size = _payload(c, type_text)
            op = c.op
            groups = c.groups()
            if op == "all-reduce" and groups and len(groups[0]) > 1:
                m = _NAME.match(c.line)
                if m and _stands_for_reduce_scatter(m.group(1), _elements(type_text),
                                                    len(groups[0]), lines):
                    op, rewritten = "reduce-scatter", rewritten + 1
            axes = _permute_axes(groups, mesh) if op == "collective-permute" else c.axes(mesh)
            if axes == () or (groups and len(groups[0]) <= 1 and op != "collective-permute"):
                continue  # a group of one device moves nothing
            out[f"{op}@{','.join(axes) if axes else '?'}"] += size * n
            in_branches += size * n if name in branched else 0
    return Traffic(dict(sorted(out.items())), rewritten, unknown, in_branches)


def _permute_axes(pairs: list[list[int]], mesh) -> tuple[str, ...] | None:
    """The mesh axes along which the sources and targets of a permute differ."""
    coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), axis=1)
    differ = {i for pair in pairs if len(pair) == 2
              for i in np.flatnonzero(coords[pair[0]] != coords[pair[1]])}
    return tuple(mesh.axis_names[i] for i in sorted(differ)) if pairs else None


@dataclasses.dataclass(frozen=True)
class Quantized:
    """The ZeRO++ / FP8 collectives of a step, for `theory`: a split leaf's
    gather moves `quantized.wire_bytes` (a byte per element, 4 per block's
    scale) under qwZ, a byte per element for an FP8 product's weight; under
    qgZ a product's gradient reduction moves the same int8 blocks through
    an all-to-all."""

    gather_block: int = 0  # qwZ: ZeRO-3 gathers in int8 blocks of about this size
    reduce_block: int = 0  # qgZ: products' gradients reduced in int8 blocks (on the spot)
    fp8_gather: bool = False  # FP8 products' weights gathered in e4m3, a byte each
    products: Any = None  # params tree: used only as a product's weight (master.product_only)
    fp8_products: Any = None  # params tree: used only as an FP8 product's weight

    def gathered(self, elements: int, itemsize: int, row: int | None, fp8_product: bool) -> float:
        """Bytes a split leaf's gather moves (`row`: quantized.Split.row)."""
        if self.fp8_gather and fp8_product:
            return elements
        if self.gather_block and row:
            return quantized.wire_bytes(elements, row, self.gather_block)
        return elements * itemsize

    def reduced(self, elements: int, itemsize: int, row: int | None, product: bool,
                on_the_spot: bool) -> float:
        """Bytes one reduction of a leaf's gradient moves."""
        if self.reduce_block and on_the_spot and product and row:
            return quantized.wire_bytes(elements, row, self.reduce_block)
        return elements * itemsize


def _quantized_rows(state_plan, leaves, compute, sharded) -> list[int | None]:
    """Per leaf, the row (one device's elements of one layer's ZeRO shard)
    that quantized.gather and reduce_scatter block, None where not split."""
    stacked = jax.tree.leaves(zero_lib.layer_stacks(state_plan.names))
    sizes = dict(state_plan.mesh.shape)
    rows = []
    for p, c, s, st in zip(leaves, compute, sharded, stacked):
        c, s = tuple(c) + (None,) * (p.ndim - len(c)), tuple(s) + (None,) * (p.ndim - len(s))
        shape, c, s = (p.shape[1:], c[1:], s[1:]) if st else (p.shape, c, s)
        split = quantized.split_of(shape, PartitionSpec(*s), PartitionSpec(*c), sizes)
        rows.append(None if split is None else split.row)
    return rows


def _leaf_kinds(state_plan, with_paths, compute, sharded, quant: Quantized):
    """Per leaf: its quantized row (or None), whether it is only a product's
    weight, only an FP8 product's, and whether its gradient is reduced at
    all (an FP8 amax history's "gradient" is computed whole on every device)."""
    leaves = [p for _, p in with_paths]

    def flags(tree):
        return jax.tree.leaves(tree) if tree is not None else [False] * len(leaves)

    return (_quantized_rows(state_plan, leaves, compute, sharded), flags(quant.products),
            flags(quant.fp8_products), [not fp8.is_history(path) for path, _ in with_paths])


def theory(state_plan, microbatches: int, reduce_once: bool, compute_dtype,
           gathered_once: tuple[str, ...] = (),
           quant: Quantized = Quantized()) -> dict[str, int] | None:
    """The ZeRO paper's volumes in payload bytes per device per step, for a
    layout without a pipeline (None with one): {"gradients", "parameters"}.

    With Psi_d the parameters a device computes with (its tensor-parallel
    part), g the gradient bytes and c the bytes of the copy gathered:

        stage 0        gradients Psi_d g (all-reduce)
        stages 1, 2    + parameters Psi_d c (the updated working copy, all-gathered)
        stage 3        + parameters 2 m Psi_d c (each microbatch's forward and
                       backward gather), m Psi_d c for the top-level parameters
                       in `gathered_once`, which the model gathers once and
                       keeps until their last use (a tied embedding)

    The gradients are reduced once per step, or m times where each
    microbatch's are (ZeRO-3 by default). Hybrid sharding adds the
    all-reduce of the sharded gradients' shards across the other
    data-parallel axes. Arrays ZeRO leaves whole are reduced, never gathered.
    `quant`: what ZeRO++ and FP8 move in fewer bytes (Quantized).
    """
    shape = state_plan.mesh_shape
    if shape.sizes["pipe"] > 1:
        return None
    stage = zero_lib.stage(state_plan.zero_stage)
    with_paths = jax.tree_util.tree_flatten_with_path(state_plan.abstract.params)[0]
    leaves = [p for _, p in with_paths]
    once = [getattr(path[0], "key", None) in gathered_once for path, _ in with_paths]
    compute = spec_leaves(state_plan.specs.compute)
    sharded = spec_leaves(state_plan.specs.sharded)
    elements = [shard_elements(p.shape, NamedSharding(state_plan.mesh, s))
                for p, s in zip(leaves, compute)]
    split = [s != c for s, c in zip(sharded, compute)]
    g = np.dtype(state_plan.grad_dtype).itemsize
    if state_plan.master:  # the working copy, leaf by leaf
        gathered = [p.dtype.itemsize for p in leaves]
    else:
        c = np.dtype(compute_dtype if stage.params else leaves[0].dtype).itemsize
        gathered = [c] * len(leaves)
    m = microbatches
    reductions = m if (stage.grads and not reduce_once and m > 1) else 1
    across = math.prod(shape.sizes[a] for a in DATA_AXES if a not in shape.shard_axes)
    n_zero = math.prod(shape.sizes[a] for a in shape.shard_axes)
    if not stage.opt_state:
        uses = [0] * len(leaves)
    elif stage.params:
        uses = [m if o else 2 * m for o in once]
    else:
        uses = [1] * len(leaves)
    rows, products, fp8s, reduced = _leaf_kinds(state_plan, with_paths, compute, sharded, quant)
    on_the_spot = stage.params and reductions == m  # qgZ: inside the backward pass
    grads = sum(quant.reduced(e, g, r, pr, on_the_spot) * reductions
                for e, r, pr, red in zip(elements, rows, products, reduced) if red)
    if stage.grads and across > 1:
        grads += sum(e * g // n_zero for e, s in zip(elements, split) if s)
    params = sum(quant.gathered(e, c, r, f) * u
                 for e, c, s, u, r, f in zip(elements, gathered, split, uses, rows, fp8s) if s)
    return {"gradients": round(grads), "parameters": round(params)}


def quantized_of(hooks, state_plan, model) -> Quantized:
    """What ZeRO++ and FP8 quantize in a job's collectives (`theory`)."""
    h, plan = hooks, state_plan
    if not (h.int8_gather_block or h.int8_reduce_block or h.fp8) \
            or plan.mesh_shape.sizes["pipe"] > 1:  # no theory with a pipeline
        return Quantized()
    tokens = (1, min(8, model.max_seq_len or 8))
    products, fp8s = master.product_only(model.apply, plan.abstract.params, plan.names, tokens)
    return Quantized(h.int8_gather_block, h.int8_reduce_block, bool(h.fp8), products, fp8s)
