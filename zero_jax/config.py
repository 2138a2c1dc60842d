"""The run config: frozen, typed dataclasses, one per concern.

A run is described by a TOML file with one table per section (`[model]`,
`[parallel]`, `[optim]`, `[data]`, `[train]`, `[offload]`, ...) and/or command-line flags; a flag
overrides the file. Every field has a flag named after it (`zero_stage` ->
`--zero-stage`), except the few in `_FLAG_NAMES`. The defaults are the main
job: gpt-tiny on the standard library's source, ZeRO-3 on 8 CPU devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
import types
import typing
from typing import Any

from zero_jax.checkpoint import CheckpointConfig
from zero_jax.distributed import DistributedConfig
from zero_jax.mesh import MeshShape
from zero_jax.optim import OptimConfig


class ConfigError(ValueError):
    """A run config that cannot run; raised before anything is compiled."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # a preset in models/ (gpt-tiny ... gpt3-175b, llama-tiny ... qwen2-7b), "hf:DIR" for a
    # Hugging Face config.json's shape, or "": none (GPT, every shape field given)
    name: str = "gpt-tiny"
    vocab_multiple: int = 1  # pad the vocabulary to a multiple (e.g. 128) so tensor divides it
    n_layer: int = 0  # transformer blocks (0: the preset's)
    n_head: int = 0  # attention heads (0: the preset's)
    d_model: int = 0  # residual width (0: the preset's)
    d_mlp: int = 0  # MLP width (0: the preset's, or 4 d_model)
    vocab_size: int = 0  # vocabulary (0: the preset's, else the data's)
    max_seq_len: int = 0  # positions (0: the preset's, or 2048)
    n_kv_head: int = 0  # Llama family: key/value heads (0: the preset's)
    head_dim: int = 0  # Llama family: head size (0: the preset's, or d_model / n_head)
    rope_theta: float = 0.0  # Llama family: rotary base (0: the preset's)
    tie_embeddings: str = ""  # Llama family: "true" or "false" ("": the preset's)
    attention: str = "auto"  # xla | cudnn (jax.nn.dot_product_attention); auto: cudnn on GPU in 16 bits

    SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "d_mlp", "vocab_size", "max_seq_len",
                    "n_kv_head", "head_dim", "rope_theta", "tie_embeddings")

    def shape(self) -> dict[str, Any]:
        """The shape fields given (non-zero), to override the preset's."""
        return {f: getattr(self, f) for f in self.SHAPE_FIELDS if getattr(self, f)}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    mesh: str = "cpu-8"  # a meshes/ name, a TOML path, or inline like data=2,fsdp=4
    layout: str = "auto"  # dp | fsdp | fsdp_tp | fsdp_tp_sp; auto: fsdp, or fsdp_tp with tensor > 1
    zero_stage: int | None = None  # 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters; None: the layout's
    zero_shard_axes: str = ""  # comma list narrowing the mesh's ZeRO axes ("fsdp": hybrid)
    min_shard_elements: int = 4096  # arrays smaller than this stay replicated
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved (with a pipe axis)
    virtual_stages: int = 0  # chunks per device for interleaved (0: 2 for interleaved, else 1)
    pipeline_gather_once: bool = False  # ZeRO-3: gather a stage's weights once per step, not per microbatch
    grad_reduce: str = "auto"  # step | microbatch: when accumulated gradients are reduced; auto: microbatch at stage 3


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    policy: str = "auto"  # fp32 | bf16 | fp16; auto: bf16 on accelerators, fp32 on CPU
    param_dtype: str = ""  # override: stored (master) parameters
    compute_dtype: str = ""  # override: matmuls and activations
    grad_dtype: str = ""  # override: gradient reduction and accumulation
    opt_state_dtype: str = ""  # override: optimizer moments
    initial_scale_power: int = 16  # fp16 loss scale starts at 2**power
    loss_scale_window: int = 1000  # finite steps in a row before the loss scale doubles
    hysteresis: int = 2  # overflows tolerated before the loss scale halves
    min_loss_scale: float = 1.0  # the loss scale never goes below this
    max_consecutive_skips: int = 20  # stop after this many non-finite steps in a row


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    remat: str = "none"  # none | full | dots_saveable | save_names | offload
    save_names: str = "qkv,attn_ctx,mlp_hidden"  # named activations kept (save_names) or offloaded (offload)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib" (byte-level Python source), a scripts/prepare_data.py directory, or a flat uint16 file
    seq_len: int = 128  # tokens per row fed to the model
    segment_ids: bool = False  # attend within each document only; positions restart at each


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300  # optimizer steps (the schedule's length)
    stop_at: int = 0  # stop after this step, saving a checkpoint (0: run all steps)
    batch_size: int = 32  # global batch, in rows, per optimizer step
    microbatches: int = 1  # gradient-accumulation microbatches per step
    seed: int = 0  # parameters and data order
    eval_every: int = 100  # steps between validation passes (0: only at the end)
    eval_batches: int = 8  # validation batches per pass
    metrics_out: str = ""  # JSON-lines file of per-step metrics ("" for none)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    optimizer: bool = False  # optimizer state and master weights in host memory, updated there
    params: bool = False  # ZeRO-3's stored parameter shards in host memory, fetched layer by layer


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    activations: ActivationConfig = ActivationConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    offload: OffloadConfig = OffloadConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTION_TYPES = {"model": ModelConfig, "parallel": ParallelConfig,
                  "precision": PrecisionConfig, "activations": ActivationConfig,
                  "optim": OptimConfig, "data": DataConfig, "train": TrainConfig,
                  "offload": OffloadConfig, "checkpoint": CheckpointConfig, "distributed": DistributedConfig}
# Fields whose flag is not their own name.
_FLAG_NAMES = {("model", "name"): "model", ("optim", "name"): "optimizer",
               ("data", "source"): "data", ("precision", "policy"): "precision",
               ("checkpoint", "dir"): "checkpoint_dir", ("checkpoint", "every"): "checkpoint_every",
               ("offload", "optimizer"): "offload_optimizer",
               ("offload", "params"): "offload_params"}


def _flag(section: str, field: str) -> str:
    return _FLAG_NAMES.get((section, field), field)


def _field_type(cls, field: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[field.name]
    if isinstance(hint, types.UnionType):
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are None so only given flags override."""
    for section, cls in _SECTION_TYPES.items():
        group = parser.add_argument_group(f"[{section}]")
        for f in dataclasses.fields(cls):
            kind = _field_type(cls, f)
            flag = f"--{_flag(section, f.name).replace('_', '-')}"
            if kind is bool:
                group.add_argument(flag, dest=f"{section}.{f.name}", default=None,
                                   action=argparse.BooleanOptionalAction,
                                   help=f"(default {f.default!r})")
            else:
                group.add_argument(flag, dest=f"{section}.{f.name}", type=kind, default=None,
                                   metavar=kind.__name__.upper(), help=f"(default {f.default!r})")


def _section(cls, values: dict[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    for f in dataclasses.fields(cls):
        if f.name in values:
            kind, value = _field_type(cls, f), values[f.name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                values[f.name] = float(value)
            elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"{where}.{f.name} = {value!r}: expected {kind.__name__}")
    try:
        return cls(**values)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def build(file: str | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults, then the TOML file, then `{"section.field": value}` overrides."""
    tables: dict[str, dict[str, Any]] = {s: {} for s in _SECTION_TYPES}
    if file:
        try:
            with open(file, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"--config {file}: no such file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {file}: not valid TOML ({e})") from None
        unknown = set(raw) - set(_SECTION_TYPES)
        if unknown:
            raise ConfigError(f"{file}: unknown table(s) {sorted(unknown)}; "
                              f"known: {sorted(_SECTION_TYPES)}")
        for section, values in raw.items():
            tables[section].update(values)
    for key, value in (overrides or {}).items():
        if value is not None:
            section, field = key.split(".")
            tables[section][field] = value
    return RunConfig(**{s: _section(cls, tables[s], f"[{s}]")
                        for s, cls in _SECTION_TYPES.items()})


def from_args(args: argparse.Namespace, config_file: str | None) -> RunConfig:
    return build(config_file, {k: v for k, v in vars(args).items() if "." in k})


def validate(run: RunConfig, mesh: MeshShape) -> None:
    """Checks that need the mesh; each error names the sizes and the fix."""
    t, dp = run.train, mesh.sizes["data"] * mesh.sizes["fsdp"]
    if t.steps < 1 or t.batch_size < 1 or t.microbatches < 1 or run.data.seq_len < 1:
        raise ConfigError("steps, batch_size, microbatches and seq_len must all be >= 1")
    if t.batch_size % dp:
        raise ConfigError(
            f"--batch-size {t.batch_size} is not divisible by the data-parallel size {dp} "
            f"(data={mesh.sizes['data']} x fsdp={mesh.sizes['fsdp']}); use a multiple of {dp}, "
            f"e.g. {math.ceil(t.batch_size / dp) * dp}")
    if t.batch_size % t.microbatches:
        raise ConfigError(
            f"--microbatches {t.microbatches} does not divide --batch-size {t.batch_size}; "
            "choose a divisor of the batch size")
    if (t.batch_size // t.microbatches) % dp:
        raise ConfigError(
            f"--batch-size {t.batch_size} / --microbatches {t.microbatches} = "
            f"{t.batch_size // t.microbatches} rows per microbatch, not divisible by the "
            f"data-parallel size {dp}; each microbatch is split over every data-parallel "
            f"device, so use a batch size that is a multiple of {t.microbatches * dp}")
    m = run.model
    negative = {k: v for k, v in m.shape().items() if not isinstance(v, str) and v < 0}
    if negative:
        raise ConfigError(f"[model] {negative}: shape fields must be positive (0: the preset's)")
    if m.tie_embeddings not in ("", "true", "false"):
        raise ConfigError(f"--tie-embeddings {m.tie_embeddings!r}: true or false")
    if m.attention not in ("auto", "xla", "cudnn"):
        raise ConfigError(f"--attention {m.attention!r}: choose auto, xla or cudnn")
    if run.parallel.min_shard_elements < 0:
        raise ConfigError("min_shard_elements must be >= 0")
    if run.model.vocab_multiple < 1:
        raise ConfigError(f"--vocab-multiple {run.model.vocab_multiple}: must be >= 1")
    p = run.precision
    if p.loss_scale_window < 1 or p.hysteresis < 1 or p.max_consecutive_skips < 1:
        raise ConfigError("loss_scale_window, hysteresis and max_consecutive_skips must be >= 1")
    if p.min_loss_scale <= 0:
        raise ConfigError(f"--min-loss-scale {p.min_loss_scale}: must be > 0")
    c = run.checkpoint
    if (c.resume or c.every) and not c.dir:
        raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir")
    if t.stop_at < 0 or t.stop_at > t.steps:
        raise ConfigError(f"--stop-at {t.stop_at}: must be between 1 and --steps {t.steps} (0: off)")
