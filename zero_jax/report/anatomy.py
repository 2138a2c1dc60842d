"""Where a train step spends its time: a few steps profiled, summed by op.

`profile` compiles a prepared `Job`'s train step, runs two warm-up steps,
traces the next ones with jax.profiler, and adds up the time of each
compiled op on every device's thread (the trace's events name their HLO
op). Each op is put in a category from the op's own metadata (the JAX
operation it came from): matmuls, attention, the loss head (logits and
cross-entropy over the padded vocabulary), normalisation and activations,
the scan's per-layer slicing and stacking, collectives, and the optimizer
update; forward and backward apart. `rows` prints the categories, then the
top ops.

Times are device-thread milliseconds per step, summed over the devices: on
CPU the simulated devices share the cores, so the step's wall time is about
this sum divided by the cores in use.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.analysis import hlo
from zero_jax.data import corpus as corpus_lib

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
# Model ops, by their JAX op_name (first match wins). The layer stack is a
# scan: its per-layer slicing of stacked weights and activations, stacking of
# what the backward keeps, and the loop itself are bookkeeping, not compute.
# The loss is differentiated apart from the model, so its own ops sit right
# under a bare jvp() (a pipeline's stage sits under one too, deeper).
MODEL_CATEGORIES = [
    ("scan slicing/stacking", re.compile(r"dynamic_index_in_dim|dynamic_update_index_in_dim|"
                                         r"dynamic_update_slice|dynamic_slice|/while$|"
                                         r"stack/broadcast_in_dim$")),
    ("attention", re.compile(r"bhts|softmax|attention|/(blocks|Block)/"  # and the causal mask
                             r"(le|(jit\(_where\)/)?select_n|jit\(_where\)/broadcast_in_dim)$")),
    ("loss head", re.compile(r"\.head\)?/|jvp\(\)\)?/(jit\([^)/]*\)/)?[^/]+$|"
                             r"cross_entropy|logsumexp")),
    ("embedding", re.compile(r"\.embed\)?/")),
    ("matmuls", re.compile(r"dot_general$")),
    ("norms, activations, residuals", re.compile(r".")),
]
# Outside autodiff's names: a pipeline's backward tick rebuilds its stage's
# forward (the stage's scan in a cond branch, under the stage's checkpoint)
# before it transposes it; ops of the model's modules that autodiff leaves out
# (a gather's integer indexing) are forward work; the rest of a pipeline's
# shard_map is its schedule (the ticks' buffers and selects).
REBUILT = re.compile(r"(?:^|/)checkpoint/|_fun/while/")
MODEL_SCOPE = re.compile(r"\.(embed|head|stack)\)?/|/(blocks|Block)/")
PIPELINE_SCHEDULE = re.compile(r"shard_map/")


def phase(op_name: str) -> str | None:
    """Which pass of the model an op belongs to, or None outside them: the
    forward is named jvp(...), the backward transpose(jvp(...)) (in a scanned
    stack the backward's rebuild of a layer sits inside it), and a pipeline
    rebuilds a stage's forward in its backward tick outside it (REBUILT)."""
    if "transpose(jvp(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    if REBUILT.search(op_name):
        return "backward"
    return "forward" if MODEL_SCOPE.search(op_name) else None


def category(opcode: str, op_name: str, zero_fill: bool = False) -> str:
    """An op's category: collectives by opcode; the zero-fills of the scan's
    stacked buffers (`zero_fill`, op_table) with the scan's slicing and
    stacking, whatever metadata XLA left on them; a pipeline's schedule and
    the optimizer update with step bookkeeping are the ops outside the
    model's forward and backward (`phase`); the model's ops by
    MODEL_CATEGORIES, forward or backward."""
    if opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
        return "collectives"
    if zero_fill:
        return "scan slicing/stacking"
    when = phase(op_name)
    if when is None:
        if PIPELINE_SCHEDULE.search(op_name):
            return "pipeline schedule"
        return "optimizer, gradient norm, step" if op_name else "other"
    name = next(n for n, pattern in MODEL_CATEGORIES if pattern.search(op_name))
    return name if name == "scan slicing/stacking" else f"{name} ({when})"


def op_table(hlo_text: str, layers: int) -> dict[str, tuple[str, str, bool]]:
    """HLO op name -> (opcode, JAX op_name, zero_fill) from the compiled
    module's text. zero_fill: a broadcast of a constant (or XLA's copy of
    one) shaped [n, ...], n the layers or a loop's trip count (a pipeline
    stage's layers, its ticks): a buffer a scan stacks into, which JAX
    allocates as zeros on every backend. XLA merges equal broadcasts and
    copies the result for each buffer, so their metadata name the optimizer
    or nothing. A fusion that holds a matrix product is named by it: XLA:CPU
    fuses the attention's softmax (and its backward) into the product of the
    scores, under the metadata of the softmax's reduction."""
    table, fills, products = {}, set(), fused_products(hlo_text)
    trips = re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', hlo_text)
    lengths = {layers} | {int(n) for n in trips}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([^\n]*?)\b([a-z][\w\-]*)\(([^\n]*)$",
                         hlo_text, re.M):
        name, shape, opcode, rest = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', rest)
        dims = re.match(r"\w+\[(\d+),\d", shape)  # an array shaped [layers, ...]
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        filled = (opcode == "broadcast" or name.startswith("wrapped_broadcast")) and all(
            o.startswith("constant") for o in operands)
        if dims and int(dims.group(1)) in lengths and (
                filled or (opcode == "copy" and operands and operands[0] in fills)):
            fills.add(name)
        op_name = op_name.group(1) if op_name else ""
        fused = hlo.callees(rest, ("calls",)) if opcode == "fusion" else []
        if fused and fused[0] in products:
            op_name = products[fused[0]]
        table[name] = (opcode, op_name, name in fills)
    return table


def fused_products(hlo_text: str) -> dict[str, str]:
    """Computation name -> the JAX op_name of the first matrix product in it."""
    out = {}
    for name, lines in hlo.computations(hlo_text)[0].items():
        for line in lines:
            op_name = re.search(r'op_name="([^"]*)"', line)
            if op_name and re.search(r"\b(?:dot|convolution)\(", line):
                out[name] = op_name.group(1)
                break
    return out


def op_times(trace_dir: Path, module: str) -> tuple[collections.Counter, collections.Counter]:
    """Summed self time (µs) and count of each HLO op of `module` in the trace."""
    trace = max(trace_dir.glob("plugins/profile/*/perfetto_trace.json.gz"))
    events = [e for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
              if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module
              and "hlo_op" in e["args"]]
    total, count = collections.Counter(), collections.Counter()
    for e, us in self_times(events):
        total[e["args"]["hlo_op"]] += us
        count[e["args"]["hlo_op"]] += 1
    return total, count


def self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each complete event with its duration less that of the events nested
    in it on its thread. XLA:CPU's while-loop op runs its body's first ops
    (up to the first collective, and the wait in it) on its own thread, so
    its event encloses theirs: summed whole, both would count twice."""
    out, by_thread = [], collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        open_, own = [], {}
        for e in thread:
            while open_ and open_[-1]["ts"] + open_[-1].get("dur", 0) <= e["ts"]:
                open_.pop()
            if open_:
                own[id(open_[-1])] -= e.get("dur", 0)
            own[id(e)] = e.get("dur", 0)
            open_.append(e)
        out += [(e, own[id(e)]) for e in thread]
    return out


def prepare(cfg: config_lib.RunConfig) -> tuple[job_lib.Job, corpus_lib.TokenData]:
    """The run's job and its corpus, nothing compiled."""
    corpus = corpus_lib.load(cfg.data.source)
    build, _ = models.for_run(cfg.model, corpus.vocab_size)
    return job_lib.prepare(cfg, build), corpus


def profile(job: job_lib.Job, corpus: corpus_lib.TokenData, steps: int, top: int) -> dict:
    """The step's wall time and throughput, and its device-thread time by
    category and by op (the `top` longest), over `steps` traced steps after
    two warm-up steps."""
    compiled = job.compile_train_step()
    table = op_table(compiled.as_text(), job.model.layers)
    cfg = job.run
    t = cfg.train
    state = job.init_state()

    def batch(i):
        return corpus_lib.global_batch(corpus, "train", cfg.data.seq_len, t.batch_size, t.seed,
                                     step=i, sharding=job.state_plan.batch_sharding)

    for i in range(2):  # warm-up
        state, metrics = compiled(state, batch(i))
    jax.block_until_ready(metrics)
    n = steps
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        start = time.perf_counter()
        for i in range(2, 2 + n):
            state, metrics = compiled(state, batch(i))
            jax.block_until_ready(metrics)  # one step at a time: each step's ops are its own
        wall = (time.perf_counter() - start) / n
        jax.profiler.stop_trace()
        total, count = op_times(Path(tmp), "jit_train_step")
    by_category = collections.Counter()
    for op, us in total.items():
        by_category[category(*table.get(op, ("", "", False)))] += us
    tokens = t.batch_size * cfg.data.seq_len
    return {
        "step_wall_ms": wall * 1e3, "tokens_per_s": tokens / wall,
        "device_thread_ms_per_step": sum(total.values()) / n / 1e3,
        "categories": {c: us / n / 1e3 for c, us in by_category.most_common()},
        "top_ops": [{"op": op, "ms_per_step": us / n / 1e3, "calls_per_step": count[op] / n,
                     "category": category(*table.get(op, ("", "", False))),
                     "jax_op": table.get(op, ("", "", False))[1]}
                    for op, us in total.most_common(top)],
    }


def rows(report: dict, steps: int) -> list[str]:
    """The report as a table: the categories, then the top ops."""
    out = [f"step {report['step_wall_ms']:.1f} ms wall ({report['tokens_per_s']:,.0f} tokens/s); "
           f"{report['device_thread_ms_per_step']:.1f} ms of device-thread time per step over "
           f"{jax.device_count()} devices, traced over {steps} steps"]
    all_ms = report["device_thread_ms_per_step"]
    for c, ms in report["categories"].items():
        out.append(f"  {c:<34}{ms:>9.1f} ms {ms / all_ms:>6.1%}")
    out.append(f"\n{'op':<42}{'ms/step':>9}{'calls':>7}  category / JAX op")
    for row in report["top_ops"]:
        out.append(f"{row['op'][:41]:<42}{row['ms_per_step']:>9.1f}{row['calls_per_step']:>7.0f}  "
                   f"{row['category']} / {row['jax_op'][-70:]}")
    return out
