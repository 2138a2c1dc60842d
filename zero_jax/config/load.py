"""The run config built and checked: defaults, then a TOML file, then flags.

Every value's type, choice and range is checked in one place (`_section`)
as its section is built, and the checks that need the mesh in `validate`:
all before anything is compiled. Every field has a flag named after it
(`zero_stage` -> `--zero-stage`), except the few in `_FLAG_NAMES`.
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

from zero_jax.config import paths
from zero_jax.config.sections import (DATA_PLACEHOLDER, SECTIONS, ConfigError, ModelConfig,
                                      RunConfig, Window)


def _meshes_dir() -> Path:
    """The mesh configs: the copy a (non-editable) install puts inside the
    package, else meshes/ beside the package in a source tree."""
    package = Path(__file__).resolve().parent.parent
    installed = package / "meshes"
    return installed if installed.is_dir() else package.parent / "meshes"


MESHES = _meshes_dir()  # <name>.toml per mesh; devices/<kind>.toml per accelerator kind


# Fields whose flag is not their own name.
_FLAG_NAMES = {("model", "name"): "model", ("optim", "name"): "optimizer",
               ("data", "source"): "data", ("precision", "policy"): "precision",
               ("checkpoint", "dir"): "checkpoint_dir", ("checkpoint", "every"): "checkpoint_every",
               ("offload", "optimizer"): "offload_optimizer",
               ("offload", "params"): "offload_params",
               ("zero", "quantized_weights"): "zero_quantized_weights",
               ("zero", "quantized_grads"): "zero_quantized_grads",
               ("zero", "block_size"): "zero_block_size", ("lora", "rank"): "lora_rank",
               ("lora", "alpha"): "lora_alpha", ("lora", "targets"): "lora_targets",
               ("lora", "init_from"): "lora_init_from", ("lora", "dropout"): "lora_dropout",
               ("lora", "quantize_base"): "lora_quantize_base",
               ("lora", "base_block"): "lora_base_block"}


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
    ("precision", "min_loss_scale"): _POSITIVE, ("precision", "fp8_history"): _COUNT,
    ("zero", "block_size"): Range(2), ("data", "seq_len"): _COUNT,
    ("train", "steps"): _COUNT, ("train", "stop_at"): _ANY, ("train", "batch_size"): _COUNT,
    ("train", "microbatches"): _COUNT, ("train", "eval_every"): _ANY,
    ("train", "eval_batches"): _COUNT,
    ("optim", "lr"): Range(0, math.inf, open_low=True), ("optim", "warmup_steps"): _ANY,
    ("optim", "min_lr_ratio"): _unit(closed_high=True),
    ("optim", "weight_decay"): Range(0, math.inf), ("optim", "b1"): _unit(),
    ("optim", "b2"): _unit(), ("optim", "eps"): Range(0, math.inf, open_low=True),
    ("optim", "momentum"): _unit(), ("optim", "clip_norm"): Range(0, math.inf),
    ("checkpoint", "every"): _ANY, ("checkpoint", "keep_last"): _COUNT,
    ("lora", "rank"): _ANY, ("lora", "alpha"): _POSITIVE, ("lora", "dropout"): _unit(),
    ("lora", "base_block"): _COUNT,
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
                          "directory zero-jax prepare-data wrote (or give --data DIR; "
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


def validate(run: RunConfig, data_sizes: dict[str, int]) -> None:
    """Checks that need the mesh's data-parallel axes and their sizes
    (`data_sizes`, in the mesh's order); each error names the sizes and the fix."""
    t, dp = run.train, math.prod(data_sizes.values())
    split = " x ".join(f"{a}={n}" for a, n in data_sizes.items() if n > 1) or "none"
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
        window = Window.parse(t.profile_steps)
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
