"""Plan a cluster run before booking it: search the layouts, rank them.

    python scripts/plan.py --model bloom-176b --cluster a100-80gb --nodes 48 \\
        --gpus-per-node 8 --global-batch 2048 --seq-len 2048 [--json] [--top 10] \\
        [--write-config DIR] [--include 'PP=12 TP=4 DP=8 ZeRO-1 full mb=2']

Every layout that divides the model and the cluster (zero_jax/planner/choices.py) is
estimated from abstract shapes: model-state bytes exact from the shardings,
a step's temporaries and its time analytic. Layouts that cannot fit are
pruned; of the rest, the fastest `--compile` (and any `--include`d) are
compiled on simulated CPU devices in worker processes, each with the
cluster's device count, cached by config hash: the compiled memory is shown
beside the estimate and the program's collective bytes replace the analytic
traffic. XLA:CPU widens bf16 temporaries to float32, so compiled temporaries
are an upper bound of a GPU's; fitting is decided on the estimate. XLA:CPU
compiles at most 2048 devices in one process: larger clusters are planned
from the estimates alone.

Time: compute at peak x the device's published efficiency, plus each mesh
axis's collectives over its link, nothing overlapped (conservative), and for
a pipeline the cost of its lockstep schedule (bubble included).

Offload layouts (`--offload`, where the device kind has host figures) keep
the optimizer state, and at ZeRO-3 the parameters, in host memory: they fit
when the device's bytes fit its memory and the node's devices' host bytes
fit the node's host memory; their time adds the host link's transfers and
the host update at the node's memory bandwidth.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

MAX_CPU_DEVICES = 2048  # XLA:CPU: "Multiprocess computations aren't implemented" above this


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--vocab-size", type=int, default=50257, help="for presets without one")
    p.add_argument("--cluster", required=True, help="a device kind in meshes/devices/")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=0, help="default: the device kind's")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to consider")
    p.add_argument("--remat", default="full,none", help="activation policies to consider")
    p.add_argument("--micro", default="1,2,4,8", help="microbatch sizes to consider")
    p.add_argument("--offload", default="none,opt,opt+params",
                   help="host offload to consider: none, opt (optimizer state), opt+params (ZeRO-3)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--compile", type=int, default=4, help="compile the best N that fit (0: none)")
    p.add_argument("--include", action="append", default=[],
                   help="a layout to show and compile whatever its rank (label prefix)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/zero_jax/plan"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--write-config", metavar="DIR")
    return p.parse_args(argv)


def base_config(args) -> dict:
    return {"model.name": args.model, "model.vocab_size": 0, "precision.policy": args.precision,
            "data.seq_len": args.seq_len, "train.batch_size": args.global_batch,
            "activations.remat": "full"}


def _compile_worker(flat: dict, devices: int, vocab: int) -> dict:
    """In a fresh process: simulate `devices` CPU devices, compile, measure."""
    import jax
    jax.config.update("jax_num_cpu_devices", devices)
    import models
    from zero_jax import config as config_lib
    from zero_jax.planner import cost as planner
    build = models.for_run(config_lib.build(None, flat).model, vocab)[0]
    return planner.measure(flat, build)


def measured(flat: dict, devices: int, vocab: int, cache: Path, pool) -> cf.Future | dict:
    key = hashlib.sha256(json.dumps([flat, devices, vocab, _code_version()],
                                    sort_keys=True).encode()).hexdigest()[:20]
    path = cache / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    future = pool.submit(_compile_worker, flat, devices, vocab)
    future.add_done_callback(lambda f: f.exception() is None and (
        cache.mkdir(parents=True, exist_ok=True) or path.write_text(json.dumps(f.result()))))
    return future


def _code_version() -> str:
    """The library's source, so that a cached figure is from the code that runs."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted((root / "zero_jax").glob("*.py")) + sorted((root / "models").glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def main(argv=None) -> int:
    args = parse(argv)
    import models
    from zero_jax import config as config_lib, precision, remat
    from zero_jax.planner import devices as hardware
    from zero_jax.planner import choices as layouts, cost as planner
    try:
        check_counts(args)
        try:
            device = hardware.load(args.cluster)
        except ValueError as e:
            raise ValueError(f"--cluster {args.cluster}: {e}") from None
        cluster = layouts.Cluster(device, args.nodes, args.gpus_per_node or device.devices_per_node)
        base = base_config(args)
        run = config_lib.build(None, base)
        precision.resolve(args.precision, "gpu")  # each layout's job would refuse it, unsaid
        build, model_line = models.for_run(run.model, args.vocab_size)
        cfg = build(1).config
        stages = int_list("--stages", args.stages, allowed=range(4))
        remats = names("--remat", args.remat, remat.POLICIES)
        micros = int_list("--micro", args.micro)
        offloads = tuple("" if o == "none" else o
                         for o in names("--offload", args.offload, ("none", "opt", "opt+params")))
    except (ValueError, config_lib.ConfigError, FileNotFoundError) as e:  # hf:DIR, no config.json
        print(f"error: {e}", file=sys.stderr)
        return 2
    all_choices = layouts.choices(cfg, cluster, args.global_batch, stages=stages, remats=remats,
                                  micros=micros, offloads=offloads)
    if not all_choices:
        print(f"error: {no_layout(layouts.mesh_shapes(cfg, cluster), args)}", file=sys.stderr)
        return 2
    n = cluster.size
    print(f"{model_line}\n{n} x {device.name} ({args.nodes} nodes x {cluster.per_node}), global "
          f"batch {args.global_batch} x {args.seq_len}: {len(all_choices)} layouts", file=sys.stderr)
    if any(offloads) and not device.can_offload:
        print(f"no offload layouts: {args.cluster} has no host memory and link figures "
              "(meshes/devices/)", file=sys.stderr)

    # 1. Analytic: one abstract job per mesh, stage and cut; every layout on it.
    jobs, estimates = {}, []
    for choice in tqdm(all_choices, desc="estimate", file=sys.stderr):
        key = (choice.pipe, choice.tensor, choice.data, choice.zero, choice.virtual, choice.offload)
        if key not in jobs:
            try:
                jobs[key] = layouts.abstract_job(choice.flat(base), build, n)
            except (ValueError, config_lib.ConfigError) as e:
                jobs[key] = e
        if isinstance(jobs[key], Exception):
            continue
        estimates.append(planner.estimate(jobs[key], choice, cluster))
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_s)
    pinned = [e for e in estimates if any(e.choice.label.startswith(p) for p in args.include)]

    # 2. Compile the best that fit, and the pinned ones, in worker processes.
    # Measured traffic can reorder the ranking: a second round compiles what
    # has risen into the best `--compile` since. An offload layout runs the
    # collectives of the same layout without offload: that one is compiled.
    results: dict = {}  # Choice (without offload) -> compiled figures
    ranked = fitting
    if n <= MAX_CPU_DEVICES and (args.compile or pinned):
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
            for round_ in range(2):
                best = list(dict.fromkeys(_compiled_as(e.choice) for e in ranked))[:args.compile]
                todo = [c for c in dict.fromkeys(best + [_compiled_as(e.choice) for e in pinned])
                        if c not in results]
                if not todo:
                    break
                pending = {c: measured(c.flat(base), n, args.vocab_size, Path(args.cache_dir), pool)
                           for c in todo}
                for c in tqdm(todo, desc=f"compile ({round_ + 1})", file=sys.stderr):
                    got = pending[c]
                    try:
                        results[c] = got.result() if isinstance(got, cf.Future) else got
                    except Exception as err:  # noqa: BLE001 - reported in the table
                        results[c] = {"error": str(err).splitlines()[0][:200]}
                ranked = _rank(estimates, results, cluster)
    ranked = _rank(estimates, results, cluster)
    shown = ranked[:args.top] + [e for e in ranked[args.top:]
                                 if any(e.choice.label.startswith(p) for p in args.include)]
    rows = [row(e, cluster, rank=ranked.index(e) + 1) for e in shown]
    if args.json:
        print(json.dumps({"model": model_line, "cluster": device.name, "devices": n,
                          "layouts": len(all_choices), "fitting": len(fitting), "top": rows},
                         indent=1))
    else:
        print_table(rows, device, len(fitting), len(all_choices))
    if args.write_config and ranked and ranked[0].fits:
        write_config(Path(args.write_config), ranked[0], base, cluster)
        print(f"wrote {args.write_config}/mesh.toml and run.toml: "
              f"python scripts/train.py --config {args.write_config}/run.toml", file=sys.stderr)
    return 0


def check_counts(args) -> None:
    """The counts given on the command line: each a whole number in range."""
    for flag, value, low in (("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 0),
                             ("--global-batch", args.global_batch, 1),
                             ("--vocab-size", args.vocab_size, 1), ("--top", args.top, 1),
                             ("--compile", args.compile, 0), ("--workers", args.workers, 1)):
        if value < low:
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


def _compiled_as(choice):
    """The layout compiled for `choice`'s figures: itself without offload."""
    return dataclasses.replace(choice, offload="")


def _rank(estimates, results: dict, cluster) -> list:
    """Estimates with the compiled figures where measured, fitting and fastest first.
    An offload layout takes its twin's collectives, not its memory."""
    from zero_jax.planner import cost as planner
    out = []
    for e in estimates:
        r = results.get(_compiled_as(e.choice))
        if r and "error" not in r:
            e = planner.with_measured(e, r, cluster)
            if e.choice.offload:
                e.compiled = {k: v for k, v in r.items() if k.startswith("collective")}
        elif r:
            e.compiled = r
        out.append(e)
    return sorted(out, key=lambda e: (not e.fits, e.step_s))


def row(e, cluster, rank: int) -> dict:
    n, dev = cluster.size, cluster.device
    out = {"rank": rank, "layout": e.choice.label, "fits": e.fits,
           "bytes": {"params": e.state["params"], "opt_state": e.state["opt_state"],
                     **{f"step_{k}": v for k, v in e.step_bytes.items()},
                     "total_estimate": e.analytic_bytes, "host": e.host_bytes},
           "headroom": e.headroom, "step_s": e.step_s, "compute_s": e.compute_s,
           "comm_s": e.comm_s, "bubble": e.bubble, "tokens_per_s": e.tokens_per_s,
           "tflops_per_device": e.tflops_per_device(n), "mfu": e.mfu(n, dev.peak_flops)}
    if e.compiled:
        keys = ("error", "argument_bytes", "temp_bytes", "collective_bytes", "collectives")
        out["compiled"] = {k: e.compiled[k] for k in keys if k in e.compiled}
    return out


def print_table(rows, device, fitting: int, total: int) -> None:
    host = (f" and {device.host_bytes_per_node / 2**40:.0f} TiB of host memory per node"
            if device.can_offload else "")
    print(f"{fitting} of {total} layouts fit in {device.hbm_bytes / 1e9:.1f} GB{host} "
          f"(estimate; 'CPU GB': compiled here, bf16 temporaries widened, an upper bound; "
          f"'host GB': offloaded, per device)")
    print(f"{'#':>4}  {'layout':<72}{'fits':>5}{'GB':>7}{'CPU GB':>8}{'host GB':>8}{'head':>7}"
          f"{'step s':>9}{'tok/s':>13}{'TFLOP/s':>9}{'MFU':>6}")
    for r in rows:
        c = r.get("compiled") or {}
        cpu = f"{(c['argument_bytes'] + c['temp_bytes']) / 1e9:.1f}" if "temp_bytes" in c else \
            ("err" if "error" in c else "-")
        print(f"{r['rank']:>4}  {r['layout']:<72}{'yes' if r['fits'] else 'no':>5}"
              f"{r['bytes']['total_estimate'] / 1e9:>7.1f}{cpu:>8}{r['bytes']['host'] / 1e9:>8.1f}"
              f"{r['headroom']:>7.0%}"
              f"{r['step_s']:>9.2f}{r['tokens_per_s']:>13,.0f}{r['tflops_per_device']:>9.1f}"
              f"{r['mfu']:>6.0%}")
    if rows:
        r = rows[0]
        b = r["bytes"]
        print(f"top: {r['layout']}: params {b['params'] / 1e9:.2f} GB + optimizer state "
              f"{b['opt_state'] / 1e9:.2f} GB stored (exact, from the shardings); step "
              f"temporaries, estimated (the largest counts): "
              + ", ".join(f"{k[5:]} {v / 1e9:.2f} GB" for k, v in b.items() if k.startswith("step_"))
              + f"; time: compute {r['compute_s']:.2f} s"
              + "".join(f", {a} {s:.2f} s" for a, s in r["comm_s"].items())
              + (" (collectives measured in the compiled program)" if "collectives" in
                 (r.get("compiled") or {}) else " (all estimated)")
              + (f", bubble {r['bubble']:.1%} of the schedule" if r["bubble"] else ""))


def write_config(directory: Path, e, base: dict, cluster) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    mesh = e.choice.mesh(cluster)
    lines = [f'description = "{e.choice.label} on {cluster.size} x {cluster.device.name}"']
    for table in ("ici", "dcn"):
        lines.append(f"\n[{table}]")
        lines += [f"{a} = {s}" for a, s in mesh[table].items() if s > 1] or ["data = 1"]
    (directory / "mesh.toml").write_text("\n".join(lines) + "\n")
    flat = e.choice.flat(base)
    flat["parallel.mesh"] = str((directory / "mesh.toml").absolute())
    sections: dict[str, dict] = {}
    for key, value in flat.items():
        section, field = key.split(".")
        sections.setdefault(section, {})[field] = value
    out = []
    for section, fields in sections.items():
        out.append(f"[{section}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
        out.append("")
    (directory / "run.toml").write_text("\n".join(out))


if __name__ == "__main__":
    raise SystemExit(main())
