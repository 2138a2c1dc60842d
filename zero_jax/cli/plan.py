"""Plan a cluster run before booking it: search the layouts, rank them.

    zero-jax plan --model bloom-176b --cluster a100-80gb --nodes 48 \\
        --gpus-per-node 8 --global-batch 2048 --seq-len 2048 [--json] [--top 10] \\
        [--write-config DIR] [--include 'PP=12 TP=4 DP=8 ZeRO-1 full mb=2']
    zero-jax plan --n-layer 24 --n-head 24 --d-model 2304 --vocab-size 51200 \\
        --cluster a100-80gb --nodes 4 --global-batch 512 --seq-len 2048
    zero-jax plan --model llama-2-70b --cluster a100-80gb --nodes 1 --global-batch 32 \\
        --seq-len 4096 --lora-rank 16 --lora-targets q,k,v,o,gate,up,down

Every layout that divides the model and the cluster
(zero_jax/planner/choices.py) is estimated from abstract shapes: model-state
bytes exact from the shardings, a step's temporaries and its time analytic.
Layouts that cannot fit are pruned; of the rest, the top of the ranking (and
any `--include`d) are compiled on simulated CPU devices in worker processes,
each with the cluster's device count, cached by config hash
(zero_jax/planner/search.py), re-ranking after each batch until the top
`--top` that fit are compiled or `--compile` layouts have been: the compiled
memory is shown beside the estimate, with which bounds which, and the
program's collective bytes replace the analytic traffic. XLA:CPU widens bf16
temporaries to float32, so compiled temporaries are an upper bound of a
GPU's; fitting is decided on the estimate. XLA:CPU compiles at most 2048
devices in one process: larger clusters are planned from the estimates
alone.

Time: each layer's kernels from their shapes (GEMMs on a roofline with
tile and wave quantisation, attention, element-wise work by its bytes;
zero_jax/planner/kernels.py) over the device kind's fitted step
efficiency (a pipeline: its schedule's cost, idle ticks and sends
included), plus what each mesh axis's collectives, each a latency plus its
bytes, leave exposed under XLA's overlap (zero_jax/planner/step_time.py),
never above the kind's best published MFU. Each layout shows model TFLOP/s (6 N +
attention) beside Megatron-formula TFLOP/s (where the layout recomputes,
every layer's forward once more), the figure Megatron-LM and
Megatron-DeepSpeed papers report.

A layout fits when the estimate plus a reserve (`--reserve-gb`; by default
the larger of 10% of the device's memory and 4 GB: collective buffers,
workspaces, the runtime's context, fragmentation) is within the device's
memory.

Offload layouts (`--offload`, where the device kind has host figures) keep
the optimizer state, and at ZeRO-3 the parameters, in host memory: they fit
when the device's bytes fit its memory and the node's devices' host bytes
fit the node's host memory; their time adds the host link's transfers and
the host update at the node's memory bandwidth.

The vocabulary is the model's own (a preset's, hf:DIR's config.json; GPT-2's
50257 for a GPT preset that names none) unless `--vocab-size` says otherwise.
Exit status: 0 a ranking with a layout that fits, 2 bad input, 3 no layout
fits (the ranking is still printed; `--write-config` writes nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

import models
from zero_jax import config as config_lib, job as job_lib
from zero_jax.config import flags
from zero_jax.config.sections import LoraConfig, ModelConfig
from zero_jax.precision import policies
from zero_jax.model import base_quant, exchange, grouped, remat
from zero_jax.planner import configs, cost, search
from zero_jax.planner.choices import Cluster, Space, choices, mesh_shapes
from zero_jax.report import plan_table
from zero_jax.runtime import device_kinds

GPT2_VOCAB = 50257  # the vocabulary of a model that names none (a GPT preset)
# The shape fields a plan takes as flags, as `zero-jax train` and `memory` do.
SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "n_kv_head", "d_mlp")
# Exit status of a plan in which no layout fits (2: a bad input).
NOTHING_FITS = 3


def parse(argv):
    kinds = ", ".join(sorted(f.stem for f in device_kinds.DIRECTORY.glob("*.toml")))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="",
                   help="a preset in models/ (gpt-tiny ... bloom-176b, llama-3-8b ...), hf:DIR, "
                        "or none: a GPT of the shape --n-layer, --n-head and --d-model give")
    shape = p.add_argument_group("the model's shape (a preset's or hf:DIR's, overridden; "
                                 "without --model, a GPT of this shape)")
    comments = flags.field_comments(ModelConfig)
    for field in SHAPE_FIELDS:
        shape.add_argument(f"--{field.replace('_', '-')}", type=int, metavar="INT",
                           help=comments[field].split(" (")[0])
    p.add_argument("--vocab-size", type=int,
                   help="the model's vocabulary; default: its own (the preset's, hf:DIR's "
                        f"config.json), else GPT-2's {GPT2_VOCAB}")
    p.add_argument("--cluster", required=True, help=f"the device kind, a file of meshes/devices/: {kinds}")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the cluster")
    p.add_argument("--gpus-per-node", type=int, help="default: the device kind's")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--precision", default="bf16", help="fp32, bf16 or fp16 (default: %(default)s)")
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"),
                   help="the attention kernel planned: cudnn's fused flash kernel, or xla's, "
                        "which writes out the scores (default: %(default)s, cudnn in 16 bits)")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to consider")
    p.add_argument("--remat", default="full,none", help="activation policies to consider")
    p.add_argument("--micro", default="1,2,4,8", help="microbatch sizes to consider")
    p.add_argument("--offload", default="none,opt,opt+params",
                   help="host offload to consider: none, opt (optimizer state), opt+params (ZeRO-3)")
    p.add_argument("--tables", default="rows,whole",
                   help="how pipelines use the embedding and head to consider "
                        "(--pipeline-tables): rows, whole")
    p.add_argument("--quantized", default="off,on",
                   help="ZeRO++'s int8 collectives (qwZ+qgZ) at ZeRO-3 to consider: off, on "
                        "(default: %(default)s)")
    _lora_arguments(p)
    p.add_argument("--top", type=int, default=10, help="layouts shown (default: %(default)s)")
    p.add_argument("--reserve-gb", type=float, default=None,
                   help="memory per device kept free beyond the estimate (default: the larger "
                        "of 10%% of the device's and 4 GB)")
    p.add_argument("--compile", type=int, default=8,
                   help="compile at most N layouts, from the top of the ranking down, "
                        "re-ranking after each batch, until the top --top that fit are "
                        "compiled (0: none; default: %(default)s)")
    p.add_argument("--include", action="append", default=[],
                   help="a layout to show and compile whatever its rank: its whole label "
                        "names it alone, a prefix every layout it begins")
    p.add_argument("--workers", type=int, default=2,
                   help="compile worker processes, each simulating the cluster's devices "
                        "(default: %(default)s)")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/zero_jax/plan"),
                   help="compiled layouts' figures, by config hash (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    p.add_argument("--write-config", metavar="DIR",
                   help="write the top layout as DIR/mesh.toml and DIR/run.toml for train --config")
    return p.parse_args(argv)


def _lora_arguments(p: argparse.ArgumentParser) -> None:
    lora = p.add_argument_group("LoRA: adapters trained on a frozen base (a fine-tune; no "
                                "pipeline layouts, which LoRA does not cut into stages yet)")
    comments = flags.field_comments(LoraConfig)
    lora.add_argument("--lora-rank", type=int, default=0, metavar="INT", help=comments["rank"])
    lora.add_argument("--lora-targets", default=LoraConfig.targets, metavar="STR",
                      help=comments["targets"] + " (default: %(default)s)")
    lora.add_argument("--lora-quantize-base", default="none", choices=base_quant.KINDS,
                      help=comments["quantize_base"] + " (default: %(default)s)")


def base_config(args) -> dict:
    """The planned run's fields. The vocabulary is the model's own (0: the
    preset's, or the data's at train time), unless --vocab-size names
    another for a model that has one, or the model is a GPT of the shape
    the flags give: then the run written carries it."""
    own = models.preset_vocab(args.model)
    given = args.vocab_size if own and args.vocab_size not in (None, own) else 0
    shape = {f"model.{f}": getattr(args, f) for f in SHAPE_FIELDS if getattr(args, f)}
    if not args.model:  # a GPT of the given shape: the vocabulary and positions planned
        given = args.vocab_size or 0
        shape["model.max_seq_len"] = args.seq_len
    return {"model.name": args.model, "model.vocab_size": given, **shape,
            "precision.policy": args.precision, "data.seq_len": args.seq_len,
            "train.batch_size": args.global_batch, "activations.remat": "full",
            "model.attention": args.attention, **({
                "lora.rank": args.lora_rank, "lora.targets": args.lora_targets,
                "lora.quantize_base": args.lora_quantize_base} if args.lora_rank else {})}


def vocab_of(args) -> int:
    """The vocabulary planned: --vocab-size, else the model's own, else GPT-2's."""
    return args.vocab_size or models.preset_vocab(args.model) or GPT2_VOCAB


def check_counts(args) -> None:
    """The counts given on the command line: each a whole number in range."""
    shape = tuple((f"--{f.replace('_', '-')}", getattr(args, f), 1) for f in SHAPE_FIELDS)
    for flag, value, low in (*shape, ("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 1),
                             ("--global-batch", args.global_batch, 1),
                             ("--vocab-size", args.vocab_size, 1), ("--top", args.top, 1),
                             ("--compile", args.compile, 0), ("--workers", args.workers, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} {value}: must be at least {low}")


def int_list(flag: str, text: str, allowed=None) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4): positive whole numbers (or those `allowed`)."""
    try:
        values = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text}: expected whole numbers separated by commas, "
                         "e.g. 1,2,4") from None
    bad = [v for v in values if (v not in allowed if allowed is not None else v < 1)]
    if bad:
        raise ValueError(f"{flag} {text}: {', '.join(map(str, bad))} not allowed; choose from "
                         + (", ".join(map(str, allowed)) if allowed is not None
                            else "numbers >= 1"))
    return values


def names(flag: str, text: str, known) -> tuple[str, ...]:
    """"full,none" -> ("full", "none"), each one of `known`."""
    values = tuple(text.split(","))
    if unknown := [v for v in values if v not in known]:
        raise ValueError(f"{flag} {text}: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(known)}")
    return values


def cluster_of(args) -> Cluster:
    try:
        device = device_kinds.load(args.cluster)
    except ValueError as e:
        raise ValueError(f"--cluster {args.cluster}: {e}") from None
    if args.reserve_gb is not None and not 0 <= args.reserve_gb * 1e9 < device.hbm_bytes:
        raise ValueError(f"--reserve-gb {args.reserve_gb:g}: between 0 and the device's "
                         f"{device.hbm_bytes / 1e9:.1f} GB")
    per_node = device.devices_per_node if args.gpus_per_node is None else args.gpus_per_node
    return Cluster(device, args.nodes, per_node, args.reserve_gb)


def layout_options(args) -> Space:
    """The layouts to search over (planner.choices.Space), from the flags."""
    offloads = names("--offload", args.offload, ("none", "opt", "opt+params"))
    return Space(stages=int_list("--stages", args.stages, allowed=range(4)),
                 schedules=() if args.lora_rank else Space.schedules,  # LoRA: no pipeline
                 remats=names("--remat", args.remat, remat.POLICIES),
                 micros=int_list("--micro", args.micro),
                 offloads=tuple("" if o == "none" else o for o in offloads),
                 tables=names("--tables", args.tables, ("rows", "whole")),
                 quantized=tuple(q == "on" for q in names("--quantized", args.quantized,
                                                          ("off", "on"))))


def problem_of(args) -> tuple[search.Problem, str, Space]:
    """The planned run, its model's line and the layout options; every flag
    checked (ValueError, ConfigError) before anything is estimated."""
    check_counts(args)
    cluster = cluster_of(args)
    base = base_config(args)
    run = config_lib.build(None, base)
    policies.resolve(args.precision, "gpu")  # each layout's job would refuse it, unsaid
    vocab = vocab_of(args)
    build, model_line = models.for_run(run.model, vocab)
    return search.Problem(base, build, cluster, vocab), model_line, layout_options(args)


def no_layout(shapes: list[tuple[int, int, int]], args) -> str:
    """Why no layout fits the batch, and what to change."""
    sizes = sorted({data for _, _, data in shapes})
    if not any(args.global_batch % d == 0 for d in sizes):
        least = sizes[0]
        return (f"--global-batch {args.global_batch}: divisible by none of the data-parallel "
                f"sizes this model and cluster allow ({', '.join(map(str, sizes))}: the devices "
                f"left over by tensor inside a node and pipe up to the layer count); use a "
                f"multiple of {least}, e.g. {-(-args.global_batch // least) * least}")
    return (f"--global-batch {args.global_batch} with --micro {args.micro}: no microbatch size "
            "divides a data-parallel replica's rows (with at least as many microbatches as "
            "pipeline stages); add smaller sizes to --micro, e.g. 1")


def nothing_fits(args, cluster: Cluster, ranked: list[cost.Estimate]) -> str:
    """No layout fits: the one that comes nearest, and what to change."""
    near = min(ranked, key=lambda e: e.peak_bytes + e.reserve)
    where = (f"{cluster.device.hbm_bytes / 1e9:.1f} GB per device with the reserve of "
             f"{near.reserve / 1e9:.1f} GB")
    if near.peak_bytes + near.reserve <= near.hbm:  # the device fits it, the host does not
        where, near_said = (f"the node's host memory ({near.memory.host_bytes / 1e9:.1f} GB a "
                            f"device)", "")
    else:
        near_said = f" (the nearest, {near.choice.label}, needs {near.peak_bytes / 1e9:.1f} GB)"
    return (f"none of the {len(ranked)} layouts fits in {where}{near_said}; add --nodes, "
            "widen the search (--stages, --remat, --micro, --offload), or shrink "
            "--global-batch or --seq-len"
            + (f"; nothing written to {args.write_config}" if args.write_config else ""))


def progress_bar(items, desc: str):
    return tqdm(items, desc=desc, file=sys.stderr)


def announce(args, problem: search.Problem, model_line: str, layouts: int, offloads) -> None:
    """What is searched, on stderr (stdout holds the table or the JSON)."""
    cluster = problem.cluster
    print(f"{model_line}\n{cluster.size} x {cluster.device.name} ({args.nodes} nodes x "
          f"{cluster.per_node}), global batch {args.global_batch} x {args.seq_len}: "
          f"{layouts} layouts", file=sys.stderr)
    if any(offloads) and not cluster.device.can_offload:
        print(f"no offload layouts: {args.cluster} has no host memory and link figures "
              "(meshes/devices/)", file=sys.stderr)


NARROW = {"bfloat16": "bf16", "float16": "f16"}  # XLA:CPU computes both in float32


def cpu_wider(policy: str) -> str:
    """How a layout compiled here holds more than on a GPU (cost.against_compiled):
    its 16-bit floats computed in float32, and XLA's attention writing out the
    scores where the GPU runs cuDNN's fused kernel; "" where neither."""
    p = policies.resolve(policy, "gpu")
    narrow = next((NARROW[d] for d in (p.compute, p.grads, p.params) if d in NARROW), None)
    parts = [narrow] if narrow else []
    if job_lib.attention_implementation("auto", "gpu", p.compute) == "cudnn":
        parts.append("scores")
    return ", ".join(parts)


def report(args, problem: search.Problem, ranked: list, model_line: str, layouts: int,
           fitting: int) -> None:
    """The top --top layouts and every --include'd one: a table or JSON."""
    shown = ranked[:args.top] + search.matching(ranked[args.top:], args.include)
    wider = cpu_wider(args.precision)
    rows = [plan_table.row(e, problem.cluster, ranked.index(e) + 1, wider) for e in shown]
    device = problem.cluster.device
    caveat = plan_table.experts_caveat(
        problem.build(1).config, ranked[0] if ranked else None, problem.cluster,
        exchange.resolve(problem.base.get("model.expert_exchange", "auto"), "gpu"),
        grouped.resolve(problem.base.get("model.expert_gemm", "auto")),
        problem.base.get("model.expert_dispatch", "auto"))
    if args.json:
        print(json.dumps({"model": model_line, "cluster": device.name,
                          "devices": problem.cluster.size, "layouts": layouts,
                          "fitting": fitting, "top": rows, "caveat": caveat}, indent=1))
    else:
        plan_table.print_table(rows, device, fitting, layouts)
        if caveat:
            print(caveat)


def say_compiled(args, ranked: list[cost.Estimate], compiled: int) -> None:
    """How far down the printed ranking the compiled figures reach, on stderr."""
    if not args.compile:
        return
    shown = min(args.top, sum(e.fits for e in ranked))
    done = search.compiled_top(ranked, args.top)
    more = "" if done == shown else f" (raise --compile to compile the rest of the top {shown})"
    print(f"compiled figures for {compiled} layouts (compiled now or read from --cache-dir): "
          f"the top {done} of the {shown} shown that fit are compiled{more}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        problem, model_line, options = problem_of(args)
    except (ValueError, config_lib.ConfigError, FileNotFoundError) as e:  # hf:DIR, no config.json
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = problem.build(1).config
    layouts = choices(cfg, problem.cluster, args.global_batch, options, seq_len=args.seq_len)
    if not layouts:
        print(f"error: {no_layout(mesh_shapes(cfg, problem.cluster), args)}", file=sys.stderr)
        return 2
    announce(args, problem, model_line, len(layouts), options.offloads)
    estimates = search.estimate_all(problem, layouts, progress_bar)
    results = search.compile_best(problem, estimates, search.matching(estimates, args.include),
                                  count=args.compile, top=args.top, workers=args.workers,
                                  cache_dir=Path(args.cache_dir), progress=progress_bar)
    ranked = search.rank(estimates, results, problem.cluster)
    say_compiled(args, ranked, len(results))
    report(args, problem, ranked, model_line, len(layouts), len(search.fitting(estimates)))
    if not search.fitting(estimates):
        print(f"error: {nothing_fits(args, problem.cluster, ranked)}", file=sys.stderr)
        return NOTHING_FITS
    if args.write_config:
        mesh, run = configs.write(Path(args.write_config), ranked[0].choice, problem.base,
                                  problem.cluster)
        print(f"wrote {mesh} and {run} (copy both; set [data] source in {run.name}): "
              f"zero-jax train --config {run}", file=sys.stderr)
    return 0
