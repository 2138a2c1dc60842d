"""Dynamic loss scaling and skipped steps, with DeepSpeed's knobs.

fp16 gradients underflow unless the loss is scaled up before the backward
pass and the gradients scaled down after it. The scale starts at
2**initial_scale_power, halves when gradients overflow (after `hysteresis`
overflows), never drops below `min_scale`, and doubles after `window`
finite steps in a row, as DeepSpeed's DynamicLossScaler does.

Every run, fp16 or not, skips a step whose gradients are not finite: the
parameters and optimizer state stay bitwise unchanged, the skip is counted,
and after `max_consecutive_skips` in a row the loop stops training (never an
update from NaN gradients, unlike `optax.apply_if_finite` past its limit).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    enabled: bool = False  # scale the loss (fp16); off: the scale stays 1
    initial_scale_power: int = 16  # DeepSpeed initial_scale_power
    window: int = 1000  # DeepSpeed loss_scale_window: finite steps before doubling
    hysteresis: int = 2  # DeepSpeed hysteresis: overflows before halving
    min_scale: float = 1.0  # DeepSpeed min_loss_scale
    max_consecutive_skips: int = 20  # the loop stops after this many skips in a row


class LossScale(NamedTuple):
    scale: jax.Array  # float32: the loss is multiplied by this before the backward pass
    good_steps: jax.Array  # int32: finite steps since the last overflow or growth
    hysteresis: jax.Array  # int32: overflows left before the next halving
    skipped: jax.Array  # int32: steps skipped so far
    consecutive: jax.Array  # int32: steps skipped in a row, up to now


def init(cfg: LossScaleConfig) -> LossScale:
    scale = 2.0 ** cfg.initial_scale_power if cfg.enabled else 1.0
    def i32(v):
        return jnp.asarray(v, jnp.int32)
    return LossScale(jnp.asarray(scale, jnp.float32), i32(0), i32(cfg.hysteresis), i32(0), i32(0))


def update(cfg: LossScaleConfig, state: LossScale, finite: jax.Array) -> LossScale:
    """The state after a step whose gradients were (not) all finite."""
    skipped = state.skipped + (~finite).astype(jnp.int32)
    consecutive = jnp.where(finite, 0, state.consecutive + 1)
    if not cfg.enabled:
        return state._replace(skipped=skipped, consecutive=consecutive)
    halve = ~finite & (state.hysteresis <= 1)
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = finite & (good >= cfg.window)
    scale = jnp.where(halve, jnp.maximum(state.scale / 2, cfg.min_scale), state.scale)
    scale = jnp.where(grow, scale * 2, scale)
    hysteresis = jnp.where(finite, state.hysteresis, jnp.maximum(state.hysteresis - 1, 1))
    hysteresis = jnp.where(grow, cfg.hysteresis, hysteresis)
    return LossScale(scale, jnp.where(grow, 0, good), hysteresis, skipped, consecutive)
