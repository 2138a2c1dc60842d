"""The benchmark's cases as data: the cpu suite and the gpu-1 ladders.

A case is a run config (model, mesh, ZeRO stage, precision, remat, offload)
as `{"section.field": value}` overrides, prepared as `zero-jax train`
prepares its run. The gpu-1 suite climbs ladders of models, smallest first,
once per offload mode; a case of a ladder that does not fit ends its ladder
(measure.run_suite). `--dry-run` climbs the same ladders with tiny shapes
on CPU under a small limit.
"""

from __future__ import annotations

import dataclasses
import fnmatch

# The vocabulary of byte-level text (256 bytes and end of document): what
# gpt-tiny and llama-tiny train on in the main job.
BYTE_VOCAB = 257


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    flat: dict  # run config overrides, {"section.field": value}
    ladder: str = ""  # cases of one ladder grow in size: the first that does not fit ends it


def cpu_suite() -> list[Case]:
    """The main job's shape (gpt-tiny, 32 x 128 tokens, fp32) across layouts:
    every ZeRO stage, one device against two and eight, remat, host offload,
    a pipeline, and the Llama family."""
    base = {"model.name": "gpt-tiny", "data.seq_len": 128, "train.batch_size": 32,
            "precision.policy": "fp32", "parallel.zero_stage": 3}
    cases = {
        "gpt-tiny/fsdp8-z3": {"parallel.mesh": "fsdp=8"},
        "gpt-tiny/dp2-fsdp4-z1": {"parallel.mesh": "data=2,fsdp=4", "parallel.zero_stage": 1},
        "gpt-tiny/dp2-fsdp4-z2": {"parallel.mesh": "data=2,fsdp=4", "parallel.zero_stage": 2},
        "gpt-tiny/fsdp1": {"parallel.mesh": "fsdp=1"},
        "gpt-tiny/fsdp2-z3": {"parallel.mesh": "fsdp=2"},
        "gpt-tiny/fsdp8-z3-remat-full": {"parallel.mesh": "fsdp=8", "activations.remat": "full"},
        "gpt-tiny/fsdp8-z2-offload-opt": {"parallel.mesh": "fsdp=8", "parallel.zero_stage": 2,
                                          "offload.optimizer": True},
        "gpt-tiny/pipe2-fsdp4-1f1b": {"parallel.mesh": "pipe=2,fsdp=4", "train.microbatches": 4,
                                      "parallel.pipeline_schedule": "1f1b"},
        "llama-tiny/fsdp8-z3": {"parallel.mesh": "fsdp=8", "model.name": "llama-tiny"},
    }
    return [Case(name, {**base, **flat}) for name, flat in cases.items()]


# Offload modes of the gpu-1 ladders: config overrides. ZeRO-3 throughout:
# on one device it shards nothing, it keeps no bf16 working copy beside the
# float32 parameters (stages 1 and 2 do), and it alone offloads parameters.
OFFLOAD_MODES = {"none": {}, "opt": {"offload.optimizer": True},
                 "opt+params": {"offload.optimizer": True, "offload.params": True}}

# Ladders: family -> rungs, smallest first, each rung (model overrides,
# remat). GPT-2's vocabulary for the GPT presets (which take the data's),
# padded so the head's matmul tiles; full remat from gpt-large (774M) up.
GPT2_VOCAB = {"model.vocab_size": 50257, "model.vocab_multiple": 128}
GPU_LADDERS = {
    "gpt": {"gpt-small": ({"model.name": "gpt-small", **GPT2_VOCAB}, "none"),
            "gpt-medium": ({"model.name": "gpt-medium", **GPT2_VOCAB}, "none"),
            "gpt-large": ({"model.name": "gpt-large", **GPT2_VOCAB}, "full"),
            "gpt-xl": ({"model.name": "gpt-xl", **GPT2_VOCAB}, "full"),
            "gpt-7b": ({"model.name": "gpt-7b", **GPT2_VOCAB}, "full")},
    "llama": {"qwen2-0.5b": ({"model.name": "qwen2-0.5b"}, "none"),
              "llama-3-8b": ({"model.name": "llama-3-8b"}, "full"),
              "llama-2-13b": ({"model.name": "llama-2-13b"}, "full")},
}
# Sequence 1024 (every GPT preset's context), 8 rows per microbatch, two
# microbatches: 16,384 tokens per step.
GPU_BASE = {"data.seq_len": 1024, "train.batch_size": 16, "train.microbatches": 2,
            "precision.policy": "bf16", "parallel.mesh": "fsdp=1", "parallel.zero_stage": 3}

# --dry-run: custom GPTs small enough to compile in seconds on CPU, whose
# compiled bytes grow ~4x a rung, under a limit the third rung exceeds.
DRY_LADDERS = {"dry": {f"dry-d{d}": ({"model.name": "", "model.n_layer": 2, "model.n_head": 4,
                                      "model.d_model": d, "model.vocab_size": BYTE_VOCAB,
                                      "model.max_seq_len": 64}, "none")
                       for d in (64, 128, 512)}}
DRY_BASE = {**GPU_BASE, "data.seq_len": 64, "train.batch_size": 8}
DRY_LIMIT = 32 * 2**20


def gpu_suite(dry_run: bool = False) -> list[Case]:
    """A ladder per model family and offload mode, mode by mode."""
    ladders, base = (DRY_LADDERS, DRY_BASE) if dry_run else (GPU_LADDERS, GPU_BASE)
    return [Case(f"{name}/{mode}", {**base, **model, "activations.remat": remat, **offload},
                 ladder=f"{family}/{mode}")
            for mode, offload in OFFLOAD_MODES.items() for family, rungs in ladders.items()
            for name, (model, remat) in rungs.items()]


SUITES = ("cpu", "gpu-1")
# (timed steps, warm-up steps): the CPU suite's in a few minutes on 2 cores.
DEFAULT_STEPS = {"cpu": (5, 1), "gpu-1": (10, 2)}


def suite(name: str, dry_run: bool = False) -> list[Case]:
    """The cases of suite `name` (one of SUITES)."""
    return gpu_suite(dry_run) if name == "gpu-1" else cpu_suite()


def select(cases: list[Case], patterns: str | None) -> list[Case]:
    """The cases whose names match one of the comma-separated shell patterns."""
    if not patterns:
        return cases
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    unmatched = [p for p in wanted if not any(fnmatch.fnmatchcase(c.name, p) for c in cases)]
    if unmatched:
        raise ValueError(f"--cases {','.join(unmatched)}: no such case; choose from "
                         f"{', '.join(c.name for c in cases)}")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in wanted)]
