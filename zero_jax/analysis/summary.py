"""The resolved plan, printed before training: what runs where, and its bytes.

`describe` prints it; `tables` gives the same rows as data (W&B logs them).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import PartitionSpec

from zero_jax import step
from zero_jax.analysis.memory import STATES, MemoryReport
from zero_jax.job import Job
from zero_jax.pipeline import executor as pipeline_lib
from zero_jax.pipeline import schedule as sched_lib
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.mesh import AXES
from zero_jax.sharding.specs import entries, entry_axes, is_spec, named_leaves, spec_leaves


def shaped(shape, spec: PartitionSpec) -> str:
    """(4, 192, 768) with P(None, 'fsdp') -> '4 x 192/fsdp x 768'."""
    dims = []
    for size, entry in zip(shape, entries(spec, len(shape))):
        axes = entry_axes(entry)
        dims.append(f"{size}/{'*'.join(axes)}" if axes else str(size))
    return " x ".join(dims) or "scalar"


def interconnect(shape, processes: np.ndarray | None = None) -> str:
    """Per mesh axis: whether its collectives cross hosts (dcn) or stay inside one (ici).

    With `processes`, each mesh device's process index (a run of several
    processes), an axis's split is read from where its devices are, not
    from the config's [ici] and [dcn] sizes: `--mesh fsdp=8` written inline
    (all ici) over 4 processes of 2 devices runs fsdp across processes."""
    if processes is None:
        unit, units = ("process", "processes") if jax.process_count() > 1 else ("host", "hosts")
        splits = [(shape.ici[k], shape.dcn[k]) for k in range(len(AXES))]
    else:
        unit, units = "process", "processes"
        splits = [_split_by_process(processes, k) for k in range(len(AXES))]
    parts = []
    for a, (i, d) in zip(AXES, splits):
        if i * d == 1:
            continue
        where = (f"across {units} (dcn {d})" if i == 1 else f"across {units} (dcn {d} x ici {i})"
                 ) if d > 1 else f"inside each {unit} (ici {i})"
        parts.append(f"{a}: {where}")
    return "; ".join(parts) or "one device"


def _attention_line(job: Job) -> str:
    """The attention implementation, and how it crosses `context`."""
    ctx = job.hooks.context
    inner = ("cudnn: jax.nn.dot_product_attention's fused kernel" if job.hooks.attention == "cudnn"
             else "xla: scores and softmax written out in float32 (models/layers.py)")
    if ctx is None:
        return inner
    if ctx.strategy == "ulysses":
        return (f"ulysses over context={ctx.size}: all-to-alls to a split of the heads, "
                f"then {inner}")
    what = {"ring": "K/V blocks passed round the ring (ppermute), online softmax",
            "all-gather": "K and V gathered over context, each device its queries' rows"}
    return f"{ctx.strategy} over context={ctx.size}: {what[ctx.strategy]}, float32 blocks"


def _split_by_process(processes: np.ndarray, axis: int) -> tuple[int, int]:
    """(devices inside one process, processes) along mesh axis `axis` of a
    grid of process indices."""
    size = processes.shape[axis]
    rows = np.moveaxis(processes, axis, -1).reshape(-1, size)
    spanned = max(len(np.unique(row)) for row in rows)
    return size // spanned, spanned


def process_grid(mesh) -> np.ndarray | None:
    """Each device's process index, in the mesh's shape; None for an abstract mesh."""
    devices = getattr(mesh, "devices", None)
    if not isinstance(devices, np.ndarray):
        return None
    return np.vectorize(lambda d: d.process_index, otypes=[int])(devices)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


@dataclasses.dataclass(frozen=True)
class Table:
    """Rows under named columns: a part of the plan as data."""

    columns: tuple[str, ...]
    rows: list[tuple]


def state_layout(job: Job) -> Table:
    """One row per parameter: its stored, gradient and optimizer-state shards."""
    layout = job.layout
    params = named_leaves(layout.abstract.params)
    opt = layout.specs.sharded if zero_lib.stage(layout.zero_stage).opt_state else layout.specs.compute
    columns = [spec_leaves(t) for t in (layout.specs.params, layout.specs.grads, opt)]
    return Table(("parameter", "stored", "gradient", "optimizer state"),
                 [(path, *(shaped(leaf.shape, s) for s in specs))
                  for (path, leaf), *specs in zip(params.items(), *columns)])


def _state_rows(job: Job) -> list[str]:
    table = state_layout(job)
    width = max(len(row[0]) for row in table.rows)
    rows = [f"  {'parameter':<{width}}  {'stored':<26}  {'gradient':<26}  optimizer state"]
    for path, *shards in table.rows:
        rows.append(f"  {path:<{width}}  " + "  ".join(f"{s:<26}" for s in shards).rstrip())
    return rows


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """Right-aligned columns under `header`, the first column left-aligned."""
    cells = [header] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))) for r in cells]


def _sharded(yes: bool) -> str:
    return "sharded" if yes else "replicated"


def summary_rows(job: Job, data_line: str, model_line: str,
                 report: MemoryReport) -> list[tuple[str, str]]:
    """(label, text) rows: what runs where."""
    run, layout, shape = job.run, job.layout, job.layout.mesh_shape
    stage = zero_lib.stage(layout.zero_stage)
    sizes = shape.sizes
    dp = layout.data_parallel_size
    shard_axes = shape.shard_axes
    n_shard = math.prod(sizes[a] for a in shard_axes)
    t, ctx = run.train, job.hooks.context
    used = {n for spec in spec_leaves(layout.names) for n in spec}
    tp = [n for n in ("heads", "kv_heads", "mlp", "vocab")
          if n in used and "tensor" in layout.rules.mesh_axes(n)]
    master = ("; float32 master weights in the sharded optimizer state, a working copy "
              "stored replicated" if layout.master else "")
    # A mixture of experts, or attention across `context`, reduces each
    # microbatch whatever --grad-reduce says (step.runs_per_device); into
    # shards only where ZeRO shards the gradients.
    each = t.microbatches > 1 and (step.runs_per_device(job.model, job.hooks)
                                   or not job.reduce_once)
    reduce = ("every microbatch" + (", into shards" if stage.grads else "") if each
              else "once per step")
    return [
        ("model", f"{model_line} ({report.param_count / 1e6:.2f} M parameters)"),
        ("data", data_line),
        ("mesh", f"{shape.name}: {shape.num_devices} devices, "
                 + " ".join(f"{a}={sizes[a]}" for a in AXES)
                 + (f"; {jax.process_count()} processes" if jax.process_count() > 1 else "")),
        ("placement", interconnect(shape, process_grid(layout.mesh)
                                   if jax.process_count() > 1 else None)),
        ("layout", f"{layout.rules.name}: tensor splits "
                   + (", ".join(tp) if tp and sizes["tensor"] > 1 else "nothing")
                   + ("; sequence split over tensor between blocks"
                      if job.sequence_parallel and sizes["tensor"] > 1 else "")),
        ("precision", f"{job.policy.describe()}{master}; loss scaling "
                      + (f"from 2^{job.scale_cfg.initial_scale_power}" if job.scale_cfg.enabled
                         else "off")),
        ("remat", job.hooks.remat.describe()),
        ("attention", _attention_line(job)),
        *(("note", note) for note in job.notes),
        ("zero", f"stage {layout.zero_stage} over "
                 + (f"{'*'.join(shard_axes)} (N_d={n_shard})" if shard_axes else "no axis (N_d=1)")
                 + f": optimizer state {_sharded(stage.opt_state)}, gradients "
                   f"{_sharded(stage.grads)}, parameters {_sharded(stage.params)}; gradients "
                   f"reduced {reduce}"),
        ("states", report.formula),
        ("batch", f"global {t.batch_size} = {t.batch_size // (t.microbatches * dp)} per device x "
                  f"{t.microbatches} microbatches x {dp} data-parallel; seq {run.data.seq_len}"
                  + (f" ({run.data.seq_len // ctx.size} per device over context={ctx.size}, "
                     "zig-zag)" if ctx else "")
                  + f" -> {t.batch_size * run.data.seq_len:,} tokens/step"),
        ("optimizer", f"{run.optim.name}, lr {run.optim.lr:g} (warm-up {run.optim.warmup_steps}, "
                      f"{run.optim.decay} to x{run.optim.min_lr_ratio:g}), weight decay "
                      f"{run.optim.weight_decay:g}, clip {run.optim.clip_norm:g}; {t.steps} steps"),
    ]


def _state_row(label: str, figures: dict[str, float]) -> tuple[str, ...]:
    return (label, *(_mib(figures[k]) for k in STATES), _mib(sum(figures.values())))


def _state_figures(report: MemoryReport) -> list[tuple[str, dict[str, float]]]:
    """(label, bytes per state) rows of the model states: three ways."""
    rows = [("ZeRO formula", report.theory_bytes), ("actual shardings", report.sharded_bytes)]
    if sum(report.host_bytes.values()):
        rows += [("  in device memory", report.device_bytes),
                 ("  in host memory", report.host_bytes)]
    return rows


def memory_rows(report: MemoryReport) -> list[str]:
    """Bytes per device of the model states, three ways, and the activations."""
    rows = [_state_row(label, figures) for label, figures in _state_figures(report)]
    lines = ["memory per device (MiB)"] + _table(("", *STATES, "total"), rows)
    if report.compiled is not None:
        c = report.compiled
        lines.append(f"  compiled step: arguments {_mib(c['argument_bytes'])}, outputs "
                     f"{_mib(c['output_bytes'])}, temporaries {_mib(c['temp_bytes'])}")
    if report.activations is not None:
        a = report.activations
        lines.append(f"  activations, one microbatch: {_mib(a['analytic_bytes'])} estimated"
                     + (f" (compiled temporaries {_mib(a['compiled_temp_bytes'])})"
                        if "compiled_temp_bytes" in a else ""))
    return lines


def collective_rows(report: MemoryReport) -> list[str]:
    """Collective payload bytes per device per step: measured, and the ZeRO volumes."""
    if report.collectives is None:
        return []
    measured, theory = report.collectives.measured, report.collectives.theory
    lines = ["collectives per device per step (MiB of payload; measured in the HLO after SPMD "
             "partitioning, loops times their trip counts)"]
    lines += _table(("", "MiB"), [(k, _mib(b)) for k, b in measured.by_op.items()]
                    + [("total", _mib(measured.total))])
    if theory is not None:
        lines.append(f"  ZeRO volumes: gradients {_mib(theory['gradients'])} + parameters "
                     f"{_mib(theory['parameters'])} = {_mib(sum(theory.values()))}")
    if measured.rewritten:
        lines.append(f"  {measured.rewritten} all-reduces followed only by "
                     "a slice to the device's shard are counted as the reduce-scatters they "
                     "stand for (XLA:CPU forms none)")
    if measured.in_branches:
        lines.append(f"  {_mib(measured.in_branches)} MiB run inside pipeline "
                     "ticks' branches and are counted as if every branch ran: an upper bound")
    return lines


def tables(job: Job, data_line: str, model_line: str, report: MemoryReport) -> dict[str, Table]:
    """The plan as data, from the rows `describe` prints: what runs where,
    the model states' bytes per device, and the layout of every parameter."""
    return {
        "plan/summary": Table(("item", "value"), summary_rows(job, data_line, model_line, report)),
        "plan/memory_mib": Table(("figure", *STATES, "total"),
                                 [(label.strip(), *(figures[k] / 2**20 for k in STATES),
                                   sum(figures.values()) / 2**20)
                                  for label, figures in _state_figures(report)]),
        "plan/state_layout": state_layout(job),
    }


def describe(job: Job, data_line: str, model_line: str, compiled_step=None,
             partitioned_text: str | None = None, report: MemoryReport | None = None) -> str:
    """The plan as printed; `report`, if given, is the job's memory report
    for `compiled_step` and `partitioned_text` (computed here otherwise)."""
    if report is None:
        report = job.memory_report(compiled_step, partitioned_text)
    summary = summary_rows(job, data_line, model_line, report)
    width = max(len(label) for label, _ in summary)
    lines = ["== zero_jax plan =="] + [f"{label:<{width}}  {text}" for label, text in summary]
    lines += memory_rows(report) + collective_rows(report)
    if job.schedule is not None:
        lines += pipeline_rows(job)
    lines.append("state layout per device (optimizer-state leaves that mirror a parameter "
                 "share its optimizer-state layout):")
    lines += _state_rows(job)
    if job.layout.specs.replicated:
        lines.append(f"left whole by ZeRO ({len(job.layout.specs.replicated)} arrays):")
        lines += [f"  {path}: {why}" for path, why in job.layout.specs.replicated]
    return "\n".join(lines)


def pipeline_rows(job: Job) -> list[str]:
    """Stage placement, the schedule's cost and its tick chart."""
    s, stages = job.schedule, job.layout.stages
    head = job.model.head_cost(job.run.data.seq_len) if job.model.head_cost else 0.0
    shared = any(job.row_blocks())
    cost = sched_lib.cost(s, stages.counts, head=head, shared_ends=shared)
    waiting = (f"; weight gradients waiting, per stage: {', '.join(map(str, s.pending_w_peak()))}"
               if s.split_backward else "")
    rows = [f"pipeline   {s.name}: p={s.p} stages, m={s.m} microbatches, v={s.v} chunks per stage; "
            f"{s.ticks} fused ticks (a forward and a backward each)"
            + ("; stage weights gathered once per step" if job.run.parallel.pipeline_gather_once else ""),
            f"  microbatch inputs stashed, per stage: {', '.join(map(str, s.stash_peak()))}" + waiting,
            f"  cost {cost.total:.1f} layer-forwards per step (a backward recomputes its forward: 3; "
            f"head {head:.2f} forward, 3x with its backward, "
            + ("shared by every stage" if shared else "on the last stage") + "); idle "
            f"{cost.bubble:.3f} of that; sends not counted"]
    for d in range(s.p):
        ends = [] if shared else ((["embedding"] if d == 0 else [])
                                  + (["head and loss"] if d == s.p - 1 else []))
        chunks = [k * s.p + d for k in range(s.v)]
        spans = (f"{stages.first_layer[g]}-{stages.first_layer[g] + stages.counts[g] - 1}"
                 for g in chunks)
        rows.append(f"  stage {d}: layers {', '.join(spans)} "
                    f"({sum(stages.counts[g] for g in chunks)} of {stages.layers})"
                    + (f", runs the {' and the '.join(ends)}" if ends else ""))
    if stages.padded != stages.layers:
        rows.append(f"  {stages.slots} layer slots per chunk: {stages.padded} stored for "
                    f"{stages.layers} layers (the embedding and head count one layer each)")
    rows.append("  embedding and head stored split over pipe")
    rows += _table_rows(job)
    if s.ticks <= 80:
        rows += ["  " + line for line in s.chart().splitlines()]
    return rows


def _table_rows(job: Job) -> list[str]:
    """Whether training and evaluation use the tables where they are stored."""
    fns = job.model.pipeline
    outer, _ = fns.split(job.layout.abstract.params)
    stored, _ = fns.split(job.layout.specs.params)
    names, _ = fns.split(job.layout.names)
    misfits = pipeline_lib.tables_not_in_rows(outer, stored)
    if not fns.vocab_parallel:
        return ["  gathered over pipe at each step, their gradients summed whole (the model's "
                "embedding and head do not run on row blocks)"]
    split = pipeline_lib.split_tables(fns, outer, stored, names)
    lines = []
    if split:
        lines.append("  every stage looks up rows, computes logits and adds their gradients on "
                     "the row block it stores of the tables whose rows are "
                     f"{', '.join(split)}: nothing of them gathered or accumulated whole")
    if not misfits:
        return lines
    t = job.layout.mesh_shape.sizes["tensor"]
    tables = ", ".join(f"{path} ({shape[0]} rows)" for path, shape in misfits)
    line = (f"  gathered over pipe at each step, gradients summed whole: {tables}, not "
            f"divisible into pipe={job.schedule.p}{f' x tensor={t}' if t > 1 else ''} row blocks")
    named = named_leaves(names, is_leaf=is_spec)
    if any(named[path][0] == "vocab" for path, _ in misfits):
        line += (f"; --vocab-multiple {math.lcm(128, job.schedule.p * t)} pads the vocabulary "
                 "into such blocks")
    return lines + [line]
