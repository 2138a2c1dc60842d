"""Optimizer and learning-rate schedule from a frozen config (its values
are checked where every run config's are, in config/load.py).

Any optax GradientTransformation works with the ZeRO layouts (sharding/zero.py derives
the optimizer-state shardings from the state's structure); this file only
builds the common ones from flags.
"""

from __future__ import annotations

from typing import Any

import optax

from zero_jax.config.sections import OptimConfig



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
