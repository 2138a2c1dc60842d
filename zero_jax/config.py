"""The run config: frozen, typed dataclasses, one per concern.

A run is described by a TOML file with one table per section (`[model]`,
`[parallel]`, `[optim]`, `[data]`, `[train]`, `[offload]`, ...) and/or command-line flags; a flag
overrides the file. Every field has a flag named after it (`zero_stage` ->
`--zero-stage`), except the few in `_FLAG_NAMES`. The defaults are the main
job: gpt-tiny on the standard library's source, ZeRO-3 on 8 CPU devices.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from zero_jax import paths
from zero_jax.checkpoint.manager import CheckpointConfig
from zero_jax.optim import OptimConfig
from zero_jax.pipeline.schedule import ScheduleName
from zero_jax.precision import PresetName
from zero_jax.remat import PolicyName
from zero_jax.runtime import trace
from zero_jax.runtime.distributed import DistributedConfig
from zero_jax.sharding.mesh import DATA_AXES, MeshShape

# Choices of this file's own fields (the others' are their modules').
LayoutName = Literal["auto", "dp", "fsdp", "fsdp_tp", "fsdp_tp_sp"]  # sharding/rules.py PRESETS
GradReduce = Literal["auto", "step", "microbatch"]  # job.resolve_grad_reduce
PipelineTables = Literal["rows", "whole"]  # pipeline/executor.py row_tables
Attention = Literal["auto", "xla", "cudnn"]  # job.attention_implementation
ContextAttention = Literal["auto", "all-gather", "ring", "ulysses"]  # zero_jax/context
DtypeOverride = Literal["", "float32", "bfloat16", "float16"]  # "": the policy's
WandbMode = Literal["online", "offline"]  # wandb.init(mode=...); offline: `wandb sync` uploads later
PlanDetail = Literal["summary", "full"]  # analysis/summary.py describe


class ConfigError(ValueError):
    """A run config that cannot run; raised before anything is compiled."""


# The [data] source of a config the planner wrote (planner/configs.py): the
# plan knows the sequence length, not where the user's tokens are.
DATA_PLACEHOLDER = "SET ME: a directory scripts/prepare_data.py wrote"


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
    sliding_window: int = 0  # Llama family: each query sees the last this many positions, Mistral's (0: the preset's, or all)
    tie_embeddings: bool | None = None  # Llama family: the head is the embedding (unset: the preset's)
    n_experts: int = 0  # mixture of experts: routed experts per block (0: the preset's)
    n_experts_per_tok: int = 0  # mixture of experts: experts per token, top-k (0: the preset's)
    d_expert: int = 0  # mixture of experts: each expert's MLP width (0: the preset's)
    n_shared_experts: int = 0  # mixture of experts: always-on experts of that width (0: the preset's)
    router_aux_loss_coef: float | None = None  # mixture of experts: load-balancing loss weight (unset: the preset's)
    router_z_loss_coef: float | None = None  # mixture of experts: router z-loss weight (unset: the preset's, 0)
    capacity_factor: float | None = None  # mixture of experts: > 0 caps each expert's tokens (drops); 0: dropless (unset: the preset's)
    attention: Attention = "auto"  # xla | cudnn (jax.nn.dot_product_attention); auto: cudnn on GPU in 16 bits
    scan_layers: bool = True  # false: unroll the layer stack (longer compiles; the compiler then sees, and counts, every layer)

    SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "d_mlp", "vocab_size", "max_seq_len",
                    "n_kv_head", "head_dim", "rope_theta", "sliding_window", "tie_embeddings",
                    "n_experts",
                    "n_experts_per_tok", "d_expert", "n_shared_experts", "router_aux_loss_coef",
                    "router_z_loss_coef", "capacity_factor")
    # Fields whose zero is a choice (no router loss, dropless), not "the preset's".
    ZERO_IS_SET = ("router_aux_loss_coef", "router_z_loss_coef", "capacity_factor")

    def shape(self) -> dict[str, Any]:
        """The shape fields given (non-zero, or set), to override the preset's."""
        return {f: v for f in self.SHAPE_FIELDS
                if (v := getattr(self, f)) is not None
                and (isinstance(v, bool) or v or f in self.ZERO_IS_SET)}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    mesh: str = "cpu-8"  # a meshes/ name, a TOML path, or inline like data=2,fsdp=4
    layout: LayoutName = "auto"  # dp | fsdp | fsdp_tp | fsdp_tp_sp; auto: fsdp, or fsdp_tp with tensor > 1
    zero_stage: int | None = None  # 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters; None: the layout's
    zero_shard_axes: str = ""  # comma list narrowing the mesh's ZeRO axes ("fsdp": hybrid)
    min_shard_elements: int = 4096  # arrays smaller than this stay replicated
    pipeline_schedule: ScheduleName = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1 (with a pipe axis)
    virtual_stages: int = 0  # chunks per device for interleaved (0: 2 for interleaved, else 1)
    pipeline_gather_once: bool = False  # ZeRO-3: gather a stage's weights once per step, not per microbatch
    pipeline_tables: PipelineTables = "rows"  # rows: each stage uses its row block of the embedding and head (where pipe divides them); whole: gathered, gradients summed whole
    overlap_collectives: bool = True  # XLA:GPU: each layer's ZeRO gather issued an iteration early and its gradient reduction finished an iteration late, beside the layer scan's compute (overlap.py); other backends ignore it
    grad_reduce: GradReduce = "auto"  # step | microbatch: when accumulated gradients are reduced; auto: microbatch at stage 3
    context_attention: ContextAttention = "auto"  # all-gather | ring | ulysses: attention across a context axis; auto: ulysses where the heads split over it under cuDNN attention, else ring


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    policy: PresetName = "auto"  # fp32 | bf16 | fp16; auto: bf16 on accelerators, fp32 on CPU
    param_dtype: DtypeOverride = ""  # override: stored (master) parameters
    compute_dtype: DtypeOverride = ""  # override: matmuls and activations
    grad_dtype: DtypeOverride = ""  # override: gradient reduction and accumulation
    opt_state_dtype: DtypeOverride = ""  # override: optimizer moments
    initial_scale_power: int = 16  # fp16 loss scale starts at 2**power
    loss_scale_window: int = 1000  # finite steps in a row before the loss scale doubles
    hysteresis: int = 2  # overflows tolerated before the loss scale halves
    min_loss_scale: float = 1.0  # the loss scale never goes below this
    max_consecutive_skips: int = 20  # stop after this many non-finite steps in a row


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    remat: PolicyName = "none"  # none | full | dots_saveable | save_names | offload
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
    tensorboard_dir: str = ""  # also write the metrics as TensorBoard scalars here ("" for none)
    wandb_project: str = ""  # also log the metrics, config and plan to this W&B project ("" for none; the wandb extra)
    wandb_mode: WandbMode = "online"  # online | offline (written under $WANDB_DIR, uploaded by `wandb sync`)
    profile_steps: str = ""  # A:B: a jax.profiler trace of steps A to B - 1 ("" for none)
    profile_dir: str = ""  # where the trace goes ("": --tensorboard-dir, else ./profile)
    plan: PlanDetail = "summary"  # the plan printed before training: summary (one screen) | full (every parameter's layout, collective and pipeline tick)


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


# TOML table -> its dataclass, in the order --help lists them.
SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "precision": PrecisionConfig,
            "activations": ActivationConfig, "optim": OptimConfig, "data": DataConfig,
            "train": TrainConfig, "offload": OffloadConfig, "checkpoint": CheckpointConfig,
            "distributed": DistributedConfig}
# Fields whose flag is not their own name.
_FLAG_NAMES = {("model", "name"): "model", ("optim", "name"): "optimizer",
               ("data", "source"): "data", ("precision", "policy"): "precision",
               ("checkpoint", "dir"): "checkpoint_dir", ("checkpoint", "every"): "checkpoint_every",
               ("offload", "optimizer"): "offload_optimizer",
               ("offload", "params"): "offload_params"}




@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a field takes: from `low` (excluded if `open_low`), up to
    `high` (included if `closed_high`); NaN and infinity are never in it."""

    low: float
    high: float | None = None  # None: no upper bound, and the message says ">= low"
    open_low: bool = False
    closed_high: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value) or value < self.low or (self.open_low and value == self.low):
            return False
        return self.high is None or value < self.high or (self.closed_high and value == self.high)

    def describe(self, whole: bool) -> str:
        if self.high is None:
            kind = "a whole number" if whole else "a finite number"
            return f"{kind} {'>' if self.open_low else '>='} {self.low:g}"
        return (f"a finite number in {'(' if self.open_low else '['}{self.low:g}, "
                f"{self.high:g}{']' if self.closed_high else ')'}")


def _unit(closed_high: bool = False) -> Range:
    return Range(0, 1, closed_high=closed_high)


_POSITIVE, _COUNT, _ANY = Range(0, open_low=True), Range(1), Range(0)
# (section, field) -> its range: every number a run config holds is checked
# here, once, as its section is built.
RANGES: dict[tuple[str, str], Range] = {
    ("model", "vocab_multiple"): _COUNT, ("parallel", "min_shard_elements"): _ANY,
    ("parallel", "virtual_stages"): _ANY, ("precision", "loss_scale_window"): _COUNT,
    ("precision", "hysteresis"): _COUNT, ("precision", "max_consecutive_skips"): _COUNT,
    ("precision", "min_loss_scale"): _POSITIVE, ("data", "seq_len"): _COUNT,
    ("train", "steps"): _COUNT, ("train", "stop_at"): _ANY, ("train", "batch_size"): _COUNT,
    ("train", "microbatches"): _COUNT, ("train", "eval_every"): _ANY,
    ("train", "eval_batches"): _COUNT,
    ("optim", "lr"): Range(0, math.inf, open_low=True), ("optim", "warmup_steps"): _ANY,
    ("optim", "min_lr_ratio"): _unit(closed_high=True),
    ("optim", "weight_decay"): Range(0, math.inf), ("optim", "b1"): _unit(),
    ("optim", "b2"): _unit(), ("optim", "eps"): Range(0, math.inf, open_low=True),
    ("optim", "momentum"): _unit(), ("optim", "clip_norm"): Range(0, math.inf),
    ("checkpoint", "every"): _ANY, ("checkpoint", "keep_last"): _COUNT,
    ("checkpoint", "keep_every"): _ANY,
    # A timeout of 0 would fail every wait at once; NaN would never fire.
    ("distributed", "heartbeat_timeout_s"): _COUNT, ("distributed", "barrier_timeout_s"): _COUNT,
    ("distributed", "watchdog_warn"): _ANY, ("distributed", "watchdog_stop"): _ANY,
    ("distributed", "watchdog_min_s"): _ANY,
}


def _check_value(section: str, field: str, value: Any, choices: tuple) -> None:
    """One field's value against its choices (a Literal) or its range."""
    flag = flag_of(section, field)
    if choices and value not in choices:
        raise ValueError(f"{flag} {value!r}: choose from {', '.join(map(str, choices))}")
    if (section, field) in RANGES and value not in RANGES[(section, field)]:
        whole = isinstance(value, int)
        raise ValueError(f"{flag} {value}: must be {RANGES[(section, field)].describe(whole)}")
    if section == "model" and field in ModelConfig.SHAPE_FIELDS and not isinstance(value, bool) \
            and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{flag} {value}: shape fields must be positive, or 0 for the preset's")
    if (section, field) == ("parallel", "zero_stage") and value not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage {value}: choose 0 (DDP), 1 (optimizer state), "
                         "2 (+ gradients) or 3 (+ parameters), or leave it out for the layout's")


def _flag(section: str, field: str) -> str:
    return _FLAG_NAMES.get((section, field), field)


def flag_of(section: str, field: str) -> str:
    """The command-line flag of a config field: ("train", "batch_size") -> --batch-size."""
    return f"--{_flag(section, field).replace('_', '-')}"


def _field_hint(cls, field: dataclasses.Field):
    """A field's type, without its None (`int | None` -> int)."""
    hint = typing.get_type_hints(cls)[field.name]
    if isinstance(hint, types.UnionType):
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


def _choices(cls, field: dataclasses.Field) -> tuple:
    """A Literal field's choices; () for any other."""
    hint = _field_hint(cls, field)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def field_type(cls, field: dataclasses.Field) -> type:
    """The Python type a field's values have (a Literal's: its choices')."""
    choices = _choices(cls, field)
    return type(choices[0]) if choices else _field_hint(cls, field)


def _section(section: str, cls, values: dict[str, Any]):
    """One section's dataclass from its values: the one place every value's
    type, choices and range are checked."""
    where = f"[{section}]"
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        kind, value = field_type(cls, f), values[f.name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            values[f.name] = value = float(value)
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"{where}.{f.name} = {value!r}: expected {kind.__name__}")
        try:
            _check_value(section, f.name, value, _choices(cls, f))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return cls(**values)


def build(file: str | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults, then the TOML file, then `{"section.field": value}` overrides."""
    tables: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if file:
        try:
            with open(file, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"--config {file}: no such file") from None
        except OSError as e:  # a directory, no permission
            raise ConfigError(f"--config {file}: cannot be read ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {file}: not valid TOML ({e})") from None
        unknown = set(raw) - set(SECTIONS)
        if unknown:
            raise ConfigError(f"{file}: unknown table(s) {sorted(unknown)}; "
                              f"known: {sorted(SECTIONS)}")
        for section, values in raw.items():
            tables[section].update(values)
        _mesh_beside(file, tables["parallel"])
    for key, value in (overrides or {}).items():
        if value is not None:
            section, field = key.split(".")
            tables[section][field] = value
    run = RunConfig(**{s: _section(s, cls, tables[s]) for s, cls in SECTIONS.items()})
    if run.data.source == DATA_PLACEHOLDER:
        raise ConfigError(f"{file}: [data] source is still the plan's placeholder; set it to a "
                          "directory scripts/prepare_data.py wrote (or give --data DIR; "
                          "--data stdlib for the byte-level demo corpus)")
    return run


def _mesh_beside(file: str, parallel: dict[str, Any]) -> None:
    """A mesh file a config names by a relative path is found beside the
    config first: a config and its mesh, copied together, run from any
    working directory."""
    mesh = parallel.get("mesh")
    if isinstance(mesh, str) and "=" not in mesh and not Path(mesh).is_absolute():
        beside = Path(file).parent / mesh
        if beside.is_file():
            parallel["mesh"] = str(beside)


def validate(run: RunConfig, mesh: MeshShape) -> None:
    """Checks that need the mesh; each error names the sizes and the fix."""
    t, dp = run.train, math.prod(mesh.sizes[a] for a in DATA_AXES)
    split = " x ".join(f"{a}={mesh.sizes[a]}" for a in DATA_AXES if mesh.sizes[a] > 1) or "none"
    # (Ranges of single fields are checked as each section is built.)
    if t.batch_size % dp:
        raise ConfigError(
            f"--batch-size {t.batch_size} is not divisible by the data-parallel size {dp} "
            f"({split}); use a multiple of {dp}, "
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
    c = run.checkpoint
    if (c.resume or c.every) and not c.dir:
        raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir")
    try:
        window = trace.Window.parse(t.profile_steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if window is not None and window.first > t.steps:
        raise ConfigError(f"--profile-steps {t.profile_steps}: the run has only --steps "
                          f"{t.steps}; choose a window within it")
    if t.stop_at < 0 or t.stop_at > t.steps:
        raise ConfigError(f"--stop-at {t.stop_at}: must be between 1 and --steps {t.steps} (0: off)")
    paths.check(run)
    check_extras(run)


def check_extras(run: RunConfig) -> None:
    """Optional libraries the run's flags need: found now (without importing
    them), not once the step has compiled."""
    t = run.train
    if t.wandb_project and importlib.util.find_spec("wandb") is None:  # None also when blocked
        raise ConfigError(f"--wandb-project {t.wandb_project}: the wandb library is not "
                          "installed; pip install 'zero-jax[wandb]'")
