"""Optimizer and learning-rate schedule from a frozen config (its values
are checked where every run config's are, in config.py).

Any optax GradientTransformation works with the ZeRO layouts (sharding/zero.py derives
the optimizer-state shardings from the state's structure); this file only
builds the common ones from flags.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import optax

Optimizer = Literal["adamw", "sgd", "adafactor"]
Decay = Literal["cosine", "linear", "constant"]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: Optimizer = "adamw"  # adamw | sgd (with momentum) | adafactor
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 50  # linear warm-up from 0 to lr
    decay: Decay = "cosine"  # after warm-up: cosine | linear | constant
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of lr
    weight_decay: float = 0.1  # decoupled; only where the model's decay mask says
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam epsilon
    momentum: float = 0.9  # SGD momentum
    clip_norm: float = 1.0  # clip gradients to this global norm; 0 turns clipping off


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up, then the configured decay down to lr * min_lr_ratio.

    Warm-up update i (from 0) uses lr * (i + 1) / warmup_steps, so the first
    update already moves the parameters.
    """
    warmup = cfg.warmup_steps  # a run shorter than the warm-up stays in it
    end = cfg.lr * cfg.min_lr_ratio
    decay_steps = max(total_steps - warmup, 1)
    if cfg.decay == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.decay == "linear":
        after = optax.linear_schedule(cfg.lr, end, decay_steps)
    else:
        after = optax.constant_schedule(cfg.lr)
    if warmup == 0:
        return after
    return optax.join_schedules([lambda count: cfg.lr * (count + 1) / warmup, after], [warmup])


def optimizer(cfg: OptimConfig, lr: optax.Schedule, decay_mask: Any = None) -> optax.GradientTransformation:
    """Clipping (if on) followed by the chosen optimizer."""
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                          weight_decay=cfg.weight_decay, mask=decay_mask)
    elif cfg.name == "sgd":
        opt = optax.chain(optax.add_decayed_weights(cfg.weight_decay, decay_mask),
                          optax.sgd(lr, momentum=cfg.momentum))
    else:
        opt = optax.adafactor(lr, weight_decay_rate=cfg.weight_decay or None,
                              weight_decay_mask=decay_mask)
    if cfg.clip_norm:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)
    return opt
