"""The run config: its sections as frozen dataclasses (sections.py), built
and checked from defaults, a TOML file and flags (load.py), the flags
themselves (flags.py) and the paths a run will write (paths.py).

The bottom layer: nothing here imports anything else of zero_jax, or JAX,
so reading and checking a config costs no JAX start-up. The names below are
the config's public face (`zero_jax.config.build`, `zero_jax.config.RunConfig`).
"""

from zero_jax.config.load import RANGES, Range, build, check_extras, field_type, flag_of, validate
from zero_jax.config.sections import (DATA_PLACEHOLDER, SECTIONS, ActivationConfig,
                                      CheckpointConfig, ConfigError, DataConfig,
                                      DistributedConfig, LayoutName, ModelConfig, OffloadConfig,
                                      OptimConfig, ParallelConfig, PrecisionConfig, RunConfig,
                                      TrainConfig, Window)

__all__ = ["RANGES", "Range", "build", "check_extras", "field_type", "flag_of", "validate",
           "DATA_PLACEHOLDER", "SECTIONS", "ActivationConfig", "CheckpointConfig", "ConfigError",
           "DataConfig", "DistributedConfig", "LayoutName", "ModelConfig", "OffloadConfig",
           "OptimConfig", "ParallelConfig", "PrecisionConfig", "RunConfig", "TrainConfig",
           "Window"]
