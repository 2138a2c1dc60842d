"""Published training runs, and what the planner predicts for each.

Each run is planned at its published layout (pipe, tensor and data sizes,
global batch, sequence, activation policy, attention kernel), with the
planner's best microbatch size, ZeRO stage and schedule there, and its
figure is compared in the unit the run published: Megatron's hardware
TFLOP/s per GPU (Narayanan et al. 2021, eq. 3), model TFLOP/s per GPU
(6 N + attention, MaxText's count) or tokens/s per GPU. These are the runs
the device kinds' `step_efficiency` is fitted to (docs/planning.md#published-runs);
nothing else is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import models
from zero_jax import config as config_lib
from zero_jax.planner import choices, search
from zero_jax.runtime import device_kinds

LIMIT = 0.15  # each prediction within this of its published figure


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run: its model, layout and figure, with its source."""

    name: str
    source: str
    device: str  # meshes/devices/<device>.toml
    nodes: int
    model: dict[str, Any]  # run-config fields of its model (section.field)
    layout: tuple[int, int, int]  # pipe, tensor, data
    batch: int  # global batch, sequences
    seq_len: int
    space: choices.Space  # what of the layout the planner chooses: what the source leaves open
    attention: str  # "xla" (scores written out) or "cudnn" (fused flash)
    metric: str  # "hw TFLOP/s" | "model TFLOP/s" | "tokens/s"
    published: float  # per GPU


def _gpt(n_layer: int, n_head: int, d_model: int) -> dict[str, Any]:
    return {"model.name": "", "model.n_layer": n_layer, "model.n_head": n_head,
            "model.d_model": d_model, "model.vocab_size": 51200, "model.max_seq_len": 2048}


# Megatron-LM recomputes every layer's forward once in the backward: here
# full remat without a pipeline, and a pipeline's own rebuild with one.
# Megatron-LM 2021 kept whole optimizer states on every replica (ZeRO-0).
_MEGATRON = choices.Space(stages=(0,), remats=("full",), offloads=("",))
_MEGATRON_PIPE = choices.Space(stages=(0,), remats=("none",), schedules=("1f1b", "interleaved"),
                               offloads=("",))


def _fsdp(micro: int) -> choices.Space:
    """ZeRO-3 over every GPU, `micro` sequences per GPU in one microbatch,
    its collectives in full precision (no published run used ZeRO++)."""
    return choices.Space(stages=(3,), remats=("none", "dots_saveable", "full"), micros=(micro,),
                         offloads=("",), quantized=(False,))


NARAYANAN = ("Narayanan et al. 2021 (arXiv 2104.04473), Table 1; Megatron-LM, fp16, "
             "full recomputation, no flash attention")
RUNS = (
    Run("GPT 1.7B (24 x 2304)", NARAYANAN, "a100-80gb", 4, _gpt(24, 24, 2304), (1, 1, 32), 512,
        2048, _MEGATRON, "xla", "hw TFLOP/s", 137),
    Run("GPT 7.5B (36 x 4096)", NARAYANAN, "a100-80gb", 16, _gpt(36, 32, 4096), (1, 4, 32), 512,
        2048, _MEGATRON, "xla", "hw TFLOP/s", 142),
    # Sequence parallel: each stage's sends split over tensor, as Megatron's
    # scatter/gather of them (sec. 4.1).
    Run("GPT 1T (128 x 25600)", NARAYANAN, "a100-80gb", 384,
        {**_gpt(128, 160, 25600), "parallel.layout": "fsdp_tp_sp"}, (64, 8, 6), 3072, 2048,
        _MEGATRON_PIPE, "xla", "hw TFLOP/s", 163),
    # Its own layout: ZeRO-1, micro-batch 2, 1F1B.
    Run("BLOOM-176B", "BigScience tr11-176B-ml (Megatron-DeepSpeed), about 150 TFLOP/s per GPU "
        "as its logs count them", "a100-80gb", 48, {"model.name": "bloom-176b"}, (12, 4, 8), 2048,
        2048, choices.Space(stages=(1,), remats=("none", "full"), micros=(2,), schedules=("1f1b",),
                            offloads=("",)), "xla", "hw TFLOP/s", 150),
    # Its H100s ran at a 500 W power limit (700 W rated) with HBM2e at 2.4
    # TB/s: slower than the device TOML's H100.
    Run("Llama 3.1 8B, FSDP", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "
        "Table 1 (FSDP + torch.compile, 8 GPUs, local batch 2, selective checkpointing)",
        "h100-80gb", 1, {"model.name": "llama-3.1-8b"}, (1, 1, 8), 16, 8192,
        _fsdp(2), "cudnn", "tokens/s", 6667),
    Run("Llama2-7B, FSDP", "MaxText MaxText/configs/a3/llama_2_7b/README.md and 1vm.sh "
        "(ici_fsdp 8, per-device batch 4, cuDNN flash, remat minimal_flash)", "h100-80gb", 1,
        {"model.name": "llama-2-7b"}, (1, 1, 8), 32, 4096, _fsdp(4), "cudnn", "model TFLOP/s", 492),
)


@dataclasses.dataclass(frozen=True)
class Prediction:
    run: Run
    layout: str  # the best layout's label
    predicted: float  # in the run's metric, per GPU
    mfu: float
    at_ceiling: bool

    @property
    def ratio(self) -> float:
        return self.predicted / self.run.published


def problem(run: Run, cluster: choices.Cluster,
            space: choices.Space | None = None) -> tuple[search.Problem, list[choices.Choice]]:
    """The run as the planner searches it on `cluster`: its fields, and the
    layouts of `space` (default: the run's own, at its published layout)."""
    base = {**run.model, "data.seq_len": run.seq_len, "train.batch_size": run.batch,
            "precision.policy": "bf16", "model.attention": run.attention}
    vocab = run.model.get("model.vocab_size", 0)
    build = models.for_run(config_lib.build(None, base).model, vocab)[0]
    layouts = choices.choices(build(1).config, cluster, run.batch, space or run.space, run.seq_len)
    if space is None:
        layouts = [c for c in layouts if (c.pipe, c.tensor, c.data, c.context, c.expert)
                   == (*run.layout, 1, 1)]
    return search.Problem(base, build, cluster, vocab), layouts


def cluster_of(run: Run) -> choices.Cluster:
    device = device_kinds.load(run.device)
    return choices.Cluster(device, run.nodes, device.devices_per_node)


def predict(run: Run) -> Prediction:
    """The planner's fastest fitting layout at the run's published layout."""
    cluster = cluster_of(run)
    best = search.fitting(search.estimate_all(*problem(run, cluster)))[0]
    t, n = best.time, cluster.size
    figure = {"hw TFLOP/s": t.hardware_tflops_per_device(n),
              "model TFLOP/s": t.tflops_per_device(n),
              "tokens/s": t.tokens_per_s / n}[run.metric]
    return Prediction(run, best.choice.label, figure, t.mfu(n, cluster.device.peak_flops),
                      t.at_ceiling)


def table(predictions: list[Prediction]) -> str:
    """The docs table: each run published against predicted."""
    lines = ["| run | GPUs | layout (planner's best there) | metric, per GPU | published | "
             "predicted | ratio | MFU |",
             "|---|---|---|---|---|---|---|---|"]
    for p in predictions:
        r = p.run
        gpus = r.layout[0] * r.layout[1] * r.layout[2]
        ceiling = " (ceiling)" if p.at_ceiling else ""
        lines.append(f"| {r.name} | {gpus} {device_kinds.load(r.device).name} | {p.layout} | "
                     f"{r.metric} | {r.published:,.0f} | {p.predicted:,.0f}{ceiling} | "
                     f"{p.ratio:.2f} | {p.mfu:.1%} |")
    sources = [f"- {p.run.name}: {p.run.source}." for p in predictions]
    return "\n".join(lines + ["", "Sources:", ""] + sources)


BEGIN, END = "<!-- published-runs table: scripts/published_runs.py --write -->", "<!-- end -->"


def with_table(text: str, table: str) -> str:
    """`text` (docs/planning.md) with the table between its markers replaced."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END, text.index(BEGIN))
    return text[:start] + "\n" + table + "\n" + text[end:]


def table_in(text: str) -> str:
    """The table between the markers of `text`."""
    start = text.index(BEGIN) + len(BEGIN)
    return text[start:text.index(END, start)].strip()
