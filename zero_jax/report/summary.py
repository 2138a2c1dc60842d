"""The resolved plan, printed before training: what runs where, and its bytes.

`describe` prints it; `tables` gives the same rows as data (W&B logs them).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import PartitionSpec

from zero_jax.train import grads
from zero_jax.analysis import formula_gap
from zero_jax.report import pipeline_summary
from zero_jax.analysis.memory import STATES, MemoryReport
from zero_jax.job import Job
from zero_jax.sharding import zero as zero_lib
from zero_jax.sharding.mesh import AXES
from zero_jax.sharding.specs import entries, entry_axes, leaf_bytes, named_leaves, spec_leaves


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
             else "xla: scores and softmax written out in float32 (models/common/layers.py)")
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
    state_plan = job.state_plan
    params = named_leaves(state_plan.abstract.params)
    opt = state_plan.specs.sharded if zero_lib.stage(state_plan.zero_stage).opt_state else state_plan.specs.compute
    columns = [spec_leaves(t) for t in (state_plan.specs.params, state_plan.specs.grads, opt)]
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
    run, state_plan, shape = job.run, job.state_plan, job.state_plan.mesh_shape
    stage = zero_lib.stage(state_plan.zero_stage)
    sizes = shape.sizes
    dp = state_plan.data_parallel_size
    shard_axes = shape.shard_axes
    n_shard = math.prod(sizes[a] for a in shard_axes)
    t, ctx = run.train, job.hooks.context
    used = {n for spec in spec_leaves(state_plan.names) for n in spec}
    tp = [n for n in ("heads", "kv_heads", "mlp", "vocab")
          if n in used and "tensor" in state_plan.rules.mesh_axes(n)]
    master = ("; float32 master weights in the sharded optimizer state, a working copy "
              "stored replicated" if state_plan.master else "")
    # A mixture of experts, or attention across `context`, reduces each
    # microbatch whatever --grad-reduce says (grads.runs_per_device); into
    # shards only where ZeRO shards the gradients.
    each = t.microbatches > 1 and (grads.runs_per_device(job.model, job.hooks)
                                   or not job.reduce_once)
    reduce = ("every microbatch" + (", into shards" if stage.grads else "") if each
              else "once per step")
    return [
        ("model", f"{model_line} ({report.param_count / 1e6:.2f} M parameters"
                  + (f"; LoRA trains {report.trained_count / 1e6:.2f} M of them, the rest frozen)"
                     if report.trained_count is not None else ")")),
        ("data", data_line),
        ("mesh", f"{shape.name}: {shape.num_devices} devices, "
                 + " ".join(f"{a}={sizes[a]}" for a in AXES)
                 + (f"; {jax.process_count()} processes" if jax.process_count() > 1 else "")),
        ("placement", interconnect(shape, process_grid(state_plan.mesh)
                                   if jax.process_count() > 1 else None)),
        ("layout", f"{state_plan.rules.name}: tensor splits "
                   + (", ".join(tp) if tp and sizes["tensor"] > 1 else "nothing")
                   + ("; sequence split over tensor between blocks"
                      if job.sequence_parallel and sizes["tensor"] > 1 else "")),
        ("precision", f"{job.policy.describe()}{master}; loss scaling "
                      + (f"from 2^{job.scale_cfg.initial_scale_power}" if job.scale_cfg.enabled
                         else "off")),
        ("remat", job.hooks.remat.describe()),
        ("attention", _attention_line(job)),
        *(("note", note) for note in job.notes),
        ("zero", f"stage {state_plan.zero_stage} over "
                 + (f"{'*'.join(shard_axes)} (N_d={n_shard})" if shard_axes else "no axis (N_d=1)")
                 + f": optimizer state {_sharded(stage.opt_state)}, gradients "
                   f"{_sharded(stage.grads)}, parameters {_sharded(stage.params)}; gradients "
                   f"reduced {reduce}" + _zero_plus_plus(job)),
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


def _zero_plus_plus(job: Job) -> str:
    """What the run gathers or reduces in 8 bits (ZeRO++, FP8), for the zero row."""
    h = job.hooks
    parts = []
    if h.int8_gather_block:
        parts.append(f"parameters gathered in int8 (qwZ; blocks of about {h.int8_gather_block}, "
                     "a float32 scale each)")
    elif h.fp8 and zero_lib.stage(job.state_plan.zero_stage).params:
        parts.append("the FP8 products' weights gathered in e4m3")
    if h.int8_reduce_block:
        parts.append(f"products' gradients reduced in int8 through all-to-all (qgZ; blocks of "
                     f"about {h.int8_reduce_block}), summed in float32")
    if h.fp8:
        parts.append(f"FP8 scaling {h.fp8}" + (f" (amax history of {h.fp8_history} steps)"
                                                if h.fp8 == "delayed" else ""))
    return "; " + "; ".join(parts) if parts else ""


def _state_row(label: str, figures: dict[str, float]) -> tuple[str, ...]:
    return (label, *(_mib(figures[k]) for k in STATES), _mib(sum(figures.values())))


def _state_figures(report: MemoryReport) -> list[tuple[str, dict[str, float]]]:
    """(label, bytes per state) rows of the model states: three ways."""
    rows = [("ZeRO formula", report.theory_bytes), ("actual shardings", report.sharded_bytes)]
    if sum(report.host_bytes.values()):
        rows += [("  in device memory", report.device_bytes),
                 ("  in host memory", report.host_bytes)]
    return rows


def memory_rows(report: MemoryReport, why: str | None = None) -> list[str]:
    """Bytes per device of the model states, three ways, and the activations;
    `why` (formula_gap.describe) goes on the shardings' line where they
    differ from the formula."""
    rows = [_state_row(label, figures) for label, figures in _state_figures(report)]
    table = _table(("", *STATES, "total"), rows)
    if why:
        table[2] += f"  {why}"  # the header, the formula's row, then the shardings'
    lines = ["memory per device (MiB; the model states exact, the activations estimated)"] + table
    if report.compiled is not None:
        c = report.compiled
        lines.append(f"  compiled step, measured: arguments {_mib(c['argument_bytes'])}, outputs "
                     f"{_mib(c['output_bytes'])}, temporaries {_mib(c['temp_bytes'])}")
    if report.activations is not None:
        lines.append("  " + activation_line(report.activations))
    return lines


def activation_line(a: dict[str, float]) -> str:
    """The activations' estimate, and which of it and the compiled
    temporaries bounds the other."""
    line = f"activations, one microbatch: {_mib(a['analytic_bytes'])} estimated"
    if "compiled_temp_bytes" not in a:
        return line
    temp = _mib(a["compiled_temp_bytes"])
    if a["analytic_bytes"] > a["compiled_temp_bytes"]:
        return (line + f", an upper bound: the compiled temporaries ({temp}) hold them, in "
                "buffers XLA reuses where the estimate counts each apart")
    return line + f", below the compiled temporaries ({temp}), which hold them and the step's others"


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
    return lines + ["  " + note for note in _collective_notes(report)]


def collective_line(report: MemoryReport) -> list[str]:
    """`collective_rows` in one line, and its notes on a second."""
    if report.collectives is None:
        return []
    measured, theory = report.collectives.measured, report.collectives.theory
    ops = ", ".join(f"{k} {_mib(b)}" for k, b in sorted(measured.by_op.items(), key=lambda kv: -kv[1]))
    line = (f"collectives {_mib(measured.total)} MiB of payload per device per step, measured in "
            f"the compiled HLO" + (f" ({ops})" if ops else ""))
    if theory is not None:
        line += f"; ZeRO volumes {_mib(sum(theory.values()))}"
    notes = _collective_notes(report)
    return [line] + (["  " + "; ".join(notes)] if notes else [])


def _collective_notes(report: MemoryReport) -> list[str]:
    measured = report.collectives.measured
    notes = []
    if measured.rewritten:
        notes.append(f"{measured.rewritten} all-reduces followed only by a slice to the device's "
                     "shard are counted as the reduce-scatters they stand for (XLA:CPU forms none)")
    if measured.in_branches:
        notes.append(f"{_mib(measured.in_branches)} MiB run inside pipeline ticks' branches and "
                     "are counted as if every branch ran: an upper bound")
    return notes


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
    """The plan as printed: one screen by default, every parameter's layout,
    collective and pipeline tick under `--plan full`. `report`, if given, is
    the job's memory report for `compiled_step` and `partitioned_text`
    (computed here otherwise)."""
    if report is None:
        report = job.memory_report(compiled_step, partitioned_text)
    full = job.run.train.plan == "full"
    summary = summary_rows(job, data_line, model_line, report)
    width = max(len(label) for label, _ in summary)
    lines = ["== zero_jax plan =="] + [f"{label:<{width}}  {text}" for label, text in summary]
    lines += memory_rows(report, formula_gap.describe(job.state_plan))
    lines += collective_rows(report) if full else collective_line(report)
    if job.schedule is not None:
        lines += pipeline_summary.rows(job, full)
    lines += leaf_rows(job) if full else largest_rows(job)
    return "\n".join(lines)


def leaf_rows(job: Job) -> list[str]:
    """Every parameter's layout, and every array ZeRO leaves whole, with why."""
    lines = ["state layout per device (optimizer-state leaves that mirror a parameter "
             "share its optimizer-state layout):"] + _state_rows(job)
    replicated = job.state_plan.specs.replicated
    if replicated:
        lines.append(f"left whole by ZeRO ({len(replicated)} arrays):")
        lines += [f"  {path}: {why}" for path, why in replicated]
    return lines


def largest_rows(job: Job, count: int = 3) -> list[str]:
    """The `count` parameters that take most bytes per device, their
    layouts, and how many arrays ZeRO leaves whole."""
    state_plan = job.state_plan
    stored = leaf_bytes(state_plan.abstract.params, state_plan.specs.params, state_plan.mesh)
    grads = leaf_bytes(state_plan.abstract_grads, state_plan.specs.grads, state_plan.mesh)
    table = state_layout(job)
    order = sorted(range(len(stored)), key=lambda i: -(stored[i] + grads[i]))[:count]
    lines = [f"largest parameters per device, of {len(stored)} (--plan full: every one's "
             "layout, each collective, the pipeline's ticks)"]
    lines += _table(("", "stored", "MiB", "gradient", "MiB"),
                    [(table.rows[i][0], table.rows[i][1], _mib(stored[i]), table.rows[i][2],
                      _mib(grads[i])) for i in order])
    replicated = state_plan.specs.replicated
    if replicated:
        path, why = replicated[0]
        lines.append(f"left whole by ZeRO: {len(replicated)} arrays, e.g. {path}: {why}")
    return lines
