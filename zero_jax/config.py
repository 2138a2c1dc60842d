"""The run config: frozen, typed dataclasses, one per concern.

A run is described by a TOML file with one table per section (`[model]`,
`[parallel]`, `[optim]`, `[data]`, `[train]`, `[offload]`, ...) and/or command-line flags; a flag
overrides the file. Every field has a flag named after it (`zero_stage` ->
`--zero-stage`), except the few in `_FLAG_NAMES`. The defaults are the main
job: gpt-tiny on the standard library's source, ZeRO-3 on 8 CPU devices.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import math
import textwrap
import tokenize
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from zero_jax.runtime import trace as profile
from zero_jax.checkpoint.manager import CheckpointConfig, complete_steps
from zero_jax.runtime.distributed import DistributedConfig
from zero_jax.sharding.mesh import MeshShape
from zero_jax.optim import OptimConfig


class ConfigError(ValueError):
    """A run config that cannot run; raised before anything is compiled."""


def _require(cfg, section: str, minimum: dict[str, float], positive: tuple[str, ...] = ()) -> None:
    """Range checks of one section's numbers, each error naming the flag and
    the value. NaN and infinity are refused too: they are no count or size."""
    for field, low in minimum.items():
        value = getattr(cfg, field)
        if not (math.isfinite(value) and value >= low):
            raise ValueError(f"{flag_of(section, field)} {value}: must be a whole number >= {low}"
                             if isinstance(value, int) else
                             f"{flag_of(section, field)} {value}: must be a finite number >= {low}")
    for field in positive:
        value = getattr(cfg, field)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag_of(section, field)} {value}: must be a finite number > 0")


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
    scan_layers: bool = True  # false: unroll the layer stack (longer compiles; the compiler then sees, and counts, every layer)

    SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "d_mlp", "vocab_size", "max_seq_len",
                    "n_kv_head", "head_dim", "rope_theta", "tie_embeddings")

    def __post_init__(self):
        for f in self.SHAPE_FIELDS:
            value = getattr(self, f)
            if not isinstance(value, str) and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag_of('model', f)} {value}: shape fields must be positive, "
                                 "or 0 for the preset's")
        _require(self, "model", {"vocab_multiple": 1})

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

    def __post_init__(self):
        if self.zero_stage not in (None, 0, 1, 2, 3):
            raise ValueError(f"--zero-stage {self.zero_stage}: choose 0 (DDP), 1 (optimizer "
                             "state), 2 (+ gradients) or 3 (+ parameters), or leave it out for "
                             "the layout's")
        _require(self, "parallel", {"min_shard_elements": 0, "virtual_stages": 0})


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

    def __post_init__(self):
        _require(self, "precision", {"loss_scale_window": 1, "hysteresis": 1,
                                     "max_consecutive_skips": 1}, positive=("min_loss_scale",))


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    remat: str = "none"  # none | full | dots_saveable | save_names | offload
    save_names: str = "qkv,attn_ctx,mlp_hidden"  # named activations kept (save_names) or offloaded (offload)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib" (byte-level Python source), a scripts/prepare_data.py directory, or a flat uint16 file
    seq_len: int = 128  # tokens per row fed to the model
    segment_ids: bool = False  # attend within each document only; positions restart at each

    def __post_init__(self):
        _require(self, "data", {"seq_len": 1})


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
    profile_steps: str = ""  # A:B: a jax.profiler trace of steps A to B - 1 ("" for none)
    profile_dir: str = ""  # where the trace goes ("": --tensorboard-dir, else ./profile)

    def __post_init__(self):
        _require(self, "train", {"steps": 1, "stop_at": 0, "batch_size": 1, "microbatches": 1,
                                 "eval_every": 0, "eval_batches": 1})


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


def flag_of(section: str, field: str) -> str:
    """The command-line flag of a config field: ("train", "batch_size") -> --batch-size."""
    return f"--{_flag(section, field).replace('_', '-')}"


@functools.cache
def field_comments(cls) -> dict[str, str]:
    """{field: its comment} read from the class's source: the comment after the
    field on its line, else the comment lines right above it. The comments are
    the one place each field is described, so --help reads them from there."""
    try:
        lines = textwrap.dedent(inspect.getsource(cls)).splitlines(keepends=True)
    except (OSError, TypeError):  # no source to read (a frozen build): no texts
        return {}
    source = "".join(lines)
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    alone = {row for row in comments if lines[row - 1].lstrip().startswith("#")}
    out = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if node.end_lineno in comments:
            out[node.target.id] = comments[node.end_lineno]
            continue
        row, above = node.lineno - 1, []
        while row in alone:
            above.insert(0, comments[row])
            row -= 1
        if above:
            out[node.target.id] = " ".join(above)
    return out


def _help(cls, field: dataclasses.Field) -> str:
    """A flag's help: the field's comment and its default (argparse reads % as a format)."""
    text = field_comments(cls).get(field.name, "")
    return f"{text} (default: {field.default!r})".strip().replace("%", "%%")


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
            flag = flag_of(section, f.name)
            if kind is bool:
                group.add_argument(flag, dest=f"{section}.{f.name}", default=None,
                                   action=argparse.BooleanOptionalAction, help=_help(cls, f))
            else:
                group.add_argument(flag, dest=f"{section}.{f.name}", type=kind, default=None,
                                   metavar=kind.__name__.upper(), help=_help(cls, f))


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
        except OSError as e:  # a directory, no permission
            raise ConfigError(f"--config {file}: cannot be read ({e.strerror})") from None
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
    # (Ranges of single fields are checked as each section is built.)
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
    if m.tie_embeddings not in ("", "true", "false"):
        raise ConfigError(f"--tie-embeddings {m.tie_embeddings!r}: true or false")
    if m.attention not in ("auto", "xla", "cudnn"):
        raise ConfigError(f"--attention {m.attention!r}: choose auto, xla or cudnn")
    c = run.checkpoint
    if (c.resume or c.every) and not c.dir:
        raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir")
    try:
        window = profile.Window.parse(t.profile_steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if window is not None and window.first > t.steps:
        raise ConfigError(f"--profile-steps {t.profile_steps}: the run has only --steps "
                          f"{t.steps}; choose a window within it")
    if t.stop_at < 0 or t.stop_at > t.steps:
        raise ConfigError(f"--stop-at {t.stop_at}: must be between 1 and --steps {t.steps} (0: off)")
    check_paths(run)


def _check_init_from(path: Path) -> None:
    """--init-from names one of the three sources its loaders read (their
    own errors then say what inside it is wrong)."""
    what = ("give a checkpoint directory (train.py --checkpoint-dir), a .safetensors file or a "
            "Hugging Face model directory")
    if not path.exists():
        raise ConfigError(f"--init-from {path}: no such file or directory; {what}")
    if path.is_file() and path.suffix != ".safetensors":
        raise ConfigError(f"--init-from {path}: a file, but not .safetensors; {what}")
    if path.is_dir() and not (complete_steps(path) or (path / "config.json").exists()):
        raise ConfigError(f"--init-from {path}: holds no complete checkpoint and no Hugging "
                          f"Face config.json; {what}")


def check_paths(run: RunConfig) -> None:
    """Paths the run reads or writes only after compiling: checked now, so
    that a typo costs no compile."""
    c, t = run.checkpoint, run.train
    if c.init_from:
        _check_init_from(Path(c.init_from))
    parent = Path(t.metrics_out).parent
    if t.metrics_out and not parent.is_dir():
        raise ConfigError(f"--metrics-out {t.metrics_out}: the directory {parent} does not "
                          "exist; create it, or write the metrics elsewhere")
