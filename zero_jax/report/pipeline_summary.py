"""The pipeline's part of the printed plan (summary.describe): the
schedule, its cost, where each stage's layers and the tables run."""

from __future__ import annotations

import math

from zero_jax.job import Job
from zero_jax.pipeline import executor as executor_lib
from zero_jax.pipeline import schedule as schedule_lib
from zero_jax.sharding.specs import is_spec, named_leaves


def rows(job: Job, full: bool = True) -> list[str]:
    """The schedule, its cost and the stage placement; with `full`, a line
    per stage, what is stashed, where the tables are used and the tick chart."""
    s, stages = job.schedule, job.state_plan.stages
    head = job.model.head_cost(job.run.data.seq_len) if job.model.head_cost else 0.0
    shared = any(job.row_blocks())
    cost = schedule_lib.cost(s, stages.counts, schedule_lib.Prices(head=head), shared_ends=shared)
    waiting = (f"; weight gradients waiting, per stage: {', '.join(map(str, s.pending_w_peak()))}"
               if s.split_backward else "")
    head_line = (f"pipeline   {s.name}: p={s.p} stages, m={s.m} microbatches, v={s.v} chunks per "
                 f"stage; {s.ticks} fused ticks (a forward and a backward each)"
                 + ("; stage weights gathered once per step"
                    if job.run.parallel.pipeline_gather_once else ""))
    stash = f"  microbatch inputs stashed, per stage: {', '.join(map(str, s.stash_peak()))}" + waiting
    cost_line = (f"  cost {cost.total:.1f} layer-forwards per step (a backward recomputes its "
                 f"forward: 3; head {head:.2f} forward, 3x with its backward, "
                 + ("shared by every stage" if shared else "on the last stage") + "); idle "
                 f"{cost.bubble:.3f} of that; sends not counted")
    placed = [f"stage {d}: {_stage(job, d, shared)}" for d in range(s.p)]
    if not full:
        return [head_line, cost_line, "  " + "; ".join(placed)] + _padding(stages)
    out = [head_line, stash, cost_line] + ["  " + line for line in placed] + _padding(stages)
    out.append("  embedding and head stored split over pipe")
    out += _table_rows(job)
    if s.ticks <= 80:
        out += ["  " + line for line in s.chart().splitlines()]
    return out


def _stage(job: Job, d: int, shared: bool) -> str:
    """Pipeline stage `d`'s layers, and the ends it runs."""
    s, stages = job.schedule, job.state_plan.stages
    ends = [] if shared else ((["embedding"] if d == 0 else [])
                              + (["head and loss"] if d == s.p - 1 else []))
    chunks = [k * s.p + d for k in range(s.v)]
    spans = (f"{stages.first_layer[g]}-{stages.first_layer[g] + stages.counts[g] - 1}"
             for g in chunks)
    return (f"layers {', '.join(spans)} ({sum(stages.counts[g] for g in chunks)} of "
            f"{stages.layers})" + (f", runs the {' and the '.join(ends)}" if ends else ""))


def _padding(stages) -> list[str]:
    if stages.padded == stages.layers:
        return []
    return [f"  {stages.slots} layer slots per chunk: {stages.padded} stored for "
            f"{stages.layers} layers (the embedding and head count one layer each)"]


def _table_rows(job: Job) -> list[str]:
    """Whether training and evaluation use the tables where they are stored."""
    fns = job.model.pipeline
    outer, _ = fns.split(job.state_plan.abstract.params)
    stored, _ = fns.split(job.state_plan.specs.params)
    names, _ = fns.split(job.state_plan.names)
    misfits = executor_lib.tables_not_in_rows(outer, stored)
    if not fns.vocab_parallel:
        return ["  gathered over pipe at each step, their gradients summed whole (the model's "
                "embedding and head do not run on row blocks)"]
    split = executor_lib.split_tables(fns, outer, stored, names)
    lines = []
    if split:
        lines.append("  every stage looks up rows, computes logits and adds their gradients on "
                     "the row block it stores of the tables whose rows are "
                     f"{', '.join(split)}: nothing of them gathered or accumulated whole")
    if not misfits:
        return lines
    t = job.state_plan.mesh_shape.sizes["tensor"]
    tables = ", ".join(f"{path} ({shape[0]} rows)" for path, shape in misfits)
    line = (f"  gathered over pipe at each step, gradients summed whole: {tables}, not "
            f"divisible into pipe={job.schedule.p}{f' x tensor={t}' if t > 1 else ''} row blocks")
    named = named_leaves(names, is_leaf=is_spec)
    if any(named[path][0] == "vocab" for path, _ in misfits):
        line += (f"; --vocab-multiple {math.lcm(128, job.schedule.p * t)} pads the vocabulary "
                 "into such blocks")
    return lines + [line]
