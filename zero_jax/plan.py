"""The resolved plan, printed before training: what runs where, and its bytes."""

from __future__ import annotations

import math
import jax
from jax.sharding import PartitionSpec

from zero_jax import zero as zero_lib
from zero_jax.job import Job
from zero_jax.mesh import AXES


def shaped(shape, spec: PartitionSpec) -> str:
    """(4, 192, 768) with P(None, 'fsdp') -> '4 x 192/fsdp x 768'."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    dims = []
    for size, entry in zip(shape, entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        dims.append(f"{size}/{'*'.join(axes)}" if axes else str(size))
    return " x ".join(dims) or "scalar"


def placement(shape) -> str:
    """Per mesh axis: whether its collectives cross hosts (dcn) or stay inside one (ici)."""
    unit, units = ("process", "processes") if jax.process_count() > 1 else ("host", "hosts")
    parts = []
    for a in AXES:
        i, d = shape.ici[AXES.index(a)], shape.dcn[AXES.index(a)]
        if i * d == 1:
            continue
        where = (f"across {units} (dcn {d})" if i == 1 else f"across {units} (dcn {d} x ici {i})"
                 ) if d > 1 else f"inside each {unit} (ici {i})"
        parts.append(f"{a}: {where}")
    return "; ".join(parts) or "one device"


def _mb(n: float) -> str:
    return f"{n / 2**20:10.2f}"


def _state_rows(job: Job) -> list[str]:
    layout = job.layout
    paths = [jax.tree_util.keystr(p, simple=True, separator=".")
             for p, _ in jax.tree_util.tree_flatten_with_path(layout.abstract.params)[0]]
    is_spec = lambda x: isinstance(x, PartitionSpec)
    opt = layout.specs.sharded if zero_lib.stage(layout.zero_stage).opt_state else layout.specs.compute
    columns = [jax.tree.leaves(t, is_leaf=is_spec) for t in (layout.specs.params, layout.specs.grads, opt)]
    width = max(len(p) for p in paths)
    rows = [f"  {'parameter':<{width}}  {'stored':<26}  {'gradient':<26}  optimizer state"]
    for path, leaf, *specs in zip(paths, jax.tree.leaves(layout.abstract.params), *columns):
        rows.append(f"  {path:<{width}}  " + "  ".join(f"{shaped(leaf.shape, s):<26}" for s in specs).rstrip())
    return rows


def describe(job: Job, data_line: str, model_line: str, compiled_step=None) -> str:
    run, layout, shape = job.run, job.layout, job.layout.mesh_shape
    stage = zero_lib.stage(layout.zero_stage)
    sizes = shape.sizes
    dp = sizes["data"] * sizes["fsdp"]
    shard_axes = shape.shard_axes
    n_shard = math.prod(sizes[a] for a in shard_axes)
    t = run.train
    per_device = t.batch_size // (t.microbatches * dp)
    word = lambda b: "sharded" if b else "replicated"
    report = job.memory_report(compiled_step)
    per = report["bytes_per_param"]
    tp = [n for n in ("heads", "mlp", "vocab") if "tensor" in layout.rules.mesh_axes(n)]
    lines = [
        "== zero_jax plan ==",
        f"model      {model_line} ({report['param_count'] / 1e6:.2f} M parameters)",
        f"data       {data_line}",
        f"mesh       {shape.name}: {shape.num_devices} devices, "
        + " ".join(f"{a}={sizes[a]}" for a in AXES)
        + (f"; {jax.process_count()} processes" if jax.process_count() > 1 else ""),
        "placement  " + placement(shape),
        f"layout     {layout.rules.name}: tensor splits "
        + (", ".join(tp) if tp and sizes["tensor"] > 1 else "nothing")
        + ("; sequence split over tensor between blocks" if job.sequence_parallel and sizes["tensor"] > 1 else ""),
        f"precision  {job.policy.describe()}; "
        f"{per['params']:g} + {per['grads']:g} + {per['opt_state']:g} = "
        f"{sum(per.values()):g} bytes per parameter; loss scaling "
        + (f"from 2^{job.scale_cfg.initial_scale_power}" if job.scale_cfg.enabled else "off"),
        f"remat      {job.hooks.remat.describe()}",
        f"zero       stage {layout.zero_stage} over "
        + (f"{'*'.join(shard_axes)} (N_d={n_shard})" if shard_axes else "no axis (N_d=1)")
        + f": optimizer state {word(stage.opt_state)}, gradients {word(stage.grads)}, "
          f"parameters {word(stage.params)}",
        f"batch      global {t.batch_size} = {per_device} per device x {t.microbatches} "
        f"microbatches x {dp} data-parallel; seq {run.data.seq_len} -> "
        f"{t.batch_size * run.data.seq_len:,} tokens/step",
        f"optimizer  {run.optim.name}, lr {run.optim.lr:g} (warm-up {run.optim.warmup_steps}, "
        f"{run.optim.decay} to x{run.optim.min_lr_ratio:g}), weight decay "
        f"{run.optim.weight_decay:g}, clip {run.optim.clip_norm:g}; {t.steps} steps",
        "memory per device (MiB)      params       grads   opt_state       total",
    ]
    for name in ("theory_bytes", "sharded_bytes"):
        r = report[name]
        label = "ZeRO formula" if name == "theory_bytes" else "actual shardings"
        lines.append(f"  {label:<22}" + "".join(_mb(r[k]) + "  " for k in ("params", "grads", "opt_state"))
                     + _mb(sum(r.values())))
    if "compiled" in report:
        c = report["compiled"]
        lines.append(f"  compiled step: arguments {c['argument_bytes'] / 2**20:.2f}, outputs "
                     f"{c['output_bytes'] / 2**20:.2f}, temporaries {c['temp_bytes'] / 2**20:.2f}")
    if "activations" in report:
        a = report["activations"]
        lines.append(f"  activations, one microbatch: {a['analytic_bytes'] / 2**20:.2f} estimated"
                     + (f" (compiled temporaries {a['compiled_temp_bytes'] / 2**20:.2f})"
                        if "compiled_temp_bytes" in a else ""))
    if job.schedule is not None:
        lines += pipeline_rows(job)
    lines.append("state layout per device (optimizer-state leaves that mirror a parameter "
                 "share its optimizer-state layout):")
    lines += _state_rows(job)
    if layout.specs.replicated:
        lines.append(f"left whole by ZeRO ({len(layout.specs.replicated)} arrays):")
        lines += [f"  {path}: {why}" for path, why in layout.specs.replicated]
    return "\n".join(lines)



def pipeline_rows(job: Job) -> list[str]:
    """Stage placement, the schedule's cost and its tick chart."""
    s, layers = job.schedule, job.model.layers
    per_chunk = layers // s.chunks
    where = lambda d: ", ".join(f"{(k * s.p + d) * per_chunk}-{(k * s.p + d + 1) * per_chunk - 1}"
                                for k in range(s.v))
    rows = [f"pipeline   {s.name}: p={s.p} stages, m={s.m} microbatches, v={s.v} chunks per stage; "
            f"{s.ticks} ticks, bubble {s.bubble:.3f}, at most {s.max_in_flight()} microbatch "
            f"inputs stashed per stage"
            + ("; stage weights gathered once per step" if job.run.parallel.pipeline_gather_once else "")]
    for d in range(s.p):
        ends = (["embedding"] if d == 0 else []) + (["head and loss"] if d == s.p - 1 else [])
        rows.append(f"  stage {d}: layers {where(d)} ({per_chunk * s.v} of {layers})"
                    + (f", runs the {' and the '.join(ends)}" if ends else ""))
    # Why every stage stores them: the head is tied to the embedding, so the
    # first and last stage both need it; ZeRO still shards them within a stage.
    rows.append("  embedding and head weights are stored on every stage (sharded within it)")
    if s.ticks <= 80:
        rows += ["  " + line for line in s.chart().splitlines()]
    return rows
