"""Bytes per device of a training run, without allocating the model.

    zero-jax memory --model gpt-small --mesh fsdp=8 --zero-stage 3
    zero-jax memory --model gpt-7b --mesh fsdp=64 --zero-stage 3 \\
        --vocab-size 50257 --seq-len 2048 --batch-size 64 --json
    zero-jax memory --model bloom-176b --mesh pipe=12,data=8,tensor=4 \\
        --zero-stage 1 --precision bf16 --n-layer 72 --seq-len 2048 --batch-size 2048 --microbatches 128
    zero-jax memory --model gpt-small --seq-len 1024 --batch-size 8 --remat-table

Reports (a) the ZeRO formula, (b) the bytes of the actual shardings of
parameters, gradients and optimizer state, and (c) the compiled train step's
`memory_analysis()`, under the run's tensor parallelism and precision
policy, with the activation bytes (the model's estimate for the remat
policy, and the compiled temporaries) beside them; and the collective bytes
per device per step, measured from the compiled program beside the ZeRO
paper's volumes. Only abstract shapes are used, so the model may be far
larger than this machine; the CPU is simulated with as many devices as the
mesh needs (or --devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tomllib

import jax

import models
from zero_jax.config import flags
from zero_jax import config as config_lib, job as job_lib
from zero_jax.model import remat
from zero_jax.runtime import cpu
from zero_jax.data import corpus as corpus_lib
from zero_jax.analysis import memory
from zero_jax.report import summary
from zero_jax.sharding.mesh import MeshError
from zero_jax.sharding.rules import ShardingError


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML run config; flags override it")
    cpu.add_devices_flag(parser, default_help="the mesh's size")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled figures")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--remat-table", action="store_true",
                        help="compile once per activation policy and tabulate activation bytes")
    flags.add_flags(parser)
    args = parser.parse_args(argv)
    return flags.from_args(args, args.config), args


def main(argv: list[str] | None = None) -> int:
    try:
        run, args = parse(argv)
        devices, note = devices_for(job_lib.mesh_config(run), args.devices)
        run, batch_note = batch_for(run, args, devices)
        for line in (note, batch_note):
            if line:
                print(f"note: {line}", file=sys.stderr)
        # Before the backend starts: simulate the devices the mesh needs.
        cpu.simulate(devices)
        vocab = data_vocab(run)
        build, model_line = models.for_run(run.model, vocab)
        job = job_lib.prepare(run, build)
        # Every policy's job is checked before the first of them compiles.
        policy_jobs = remat_jobs(run, vocab) if args.remat_table else None
    except (config_lib.ConfigError, MeshError, ShardingError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if policy_jobs is not None:
        return remat_table(policy_jobs, args.json)
    compiled, text = (None, None) if args.no_compile else job.compile_with_text()
    report = job.memory_report(compiled, text)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(summary.describe(job, f"vocab {job.model.vocab_size} (shapes only)", model_line,
                            compiled, text))
    return 0


def devices_for(mesh_cfg, given: int | None, guess: int = 8) -> tuple[int, str]:
    """The devices to simulate for a mesh, and a note when the count is a
    guess: a -1 fills from the device count, which a report of shapes has
    to choose (`guess`, or the next multiple of the mesh's fixed sizes)."""
    if given is not None:
        if given < 1:
            raise MeshError(f"--devices {given}: give a device count of at least 1")
        try:
            mesh_cfg.resolve(given)
        except MeshError as e:
            raise MeshError(f"--devices {given}: {e}") from None
        return given, ""
    if -1 not in mesh_cfg.ici + mesh_cfg.dcn:
        return mesh_cfg.fixed_devices, ""
    fixed = mesh_cfg.fixed_devices
    n = -(-guess // fixed) * fixed
    name = "" if mesh_cfg.name == "inline" else f" {mesh_cfg.name}"
    return n, (f"the mesh{name} fills -1 from the device count: reporting for {n} simulated "
               "devices; give --devices N for the cluster's count")


def batch_for(run, args, devices: int):
    """The run with a batch the mesh can split: a report of a large mesh
    given no batch size (flag or config) takes one row per data-parallel
    device and microbatch where the default does not split, with a note."""
    t = run.train
    given = getattr(args, "train.batch_size") is not None
    if args.config and not given:  # read once already, by flags.from_args
        with open(args.config, "rb") as f:
            given = "batch_size" in tomllib.load(f).get("train", {})
    dp = job_lib.mesh_config(run).resolve(devices).data_parallel_size
    if given or t.batch_size % (dp * t.microbatches) == 0:
        return run, ""
    rows = dp * t.microbatches
    return (dataclasses.replace(run, train=dataclasses.replace(t, batch_size=rows)),
            f"--batch-size {t.batch_size} (the default) does not split over {dp} data-parallel "
            f"devices: reporting for {rows} rows (one per device and microbatch); give "
            "--batch-size for the run's own")


def data_vocab(run) -> int:
    """The data's vocabulary, read only when the model names none."""
    if run.model.vocab_size or models.preset_vocab(run.model.name):
        return 0
    return corpus_lib.load(run.data.source).vocab_size


def remat_jobs(run, vocab: int) -> dict:
    """The run's job under every activation policy."""
    jobs = {}
    for policy in remat.POLICIES:
        r = dataclasses.replace(run, activations=dataclasses.replace(run.activations, remat=policy))
        jobs[policy] = job_lib.prepare(r, models.for_run(r.model, vocab)[0])
    return jobs


def remat_table(jobs: dict, as_json: bool) -> int:
    """Activation bytes per device for every policy: analytic and compiled."""
    rows = {}
    for policy, job in jobs.items():
        compiled = memory.compiled(job.compile_train_step())
        rows[policy] = {"analytic_activation_bytes": job.activation_estimate(),
                        "compiled_temp_bytes": compiled["temp_bytes"]}
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    none = rows["none"]["compiled_temp_bytes"]
    print(f"{'policy':<15}{'activations (MiB, analytic)':>29}{'temp (MiB, compiled)':>23}{'vs none':>9}")
    for policy, row in rows.items():
        print(f"{policy:<15}{row['analytic_activation_bytes'] / 2**20:>29.1f}"
              f"{row['compiled_temp_bytes'] / 2**20:>23.1f}{row['compiled_temp_bytes'] / none:>9.3f}")
    print("offload: on CPU memory_analysis() does not separate host bytes, so the compiled "
          "figure counts the offloaded activations too" if jax.devices()[0].platform == "cpu" else "")
    return 0
