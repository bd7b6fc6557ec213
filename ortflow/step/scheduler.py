"""Learning-rate schedule as a pure function of the step: every engine gets the same value via set_lr."""

import math

from ortflow.config import SchedulerConfig, SchedulerName


def lr_at(step: int, base_lr: float, cfg: SchedulerConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Linear warmup over `warmup_steps` (cut to max_steps when longer), then constant, or cosine decay to
    `min_lr_ratio * base_lr` at max_steps.
    """
    warmup = min(cfg.warmup_steps, max_steps)
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if cfg.name == SchedulerName.constant:
        return base_lr
    progress = (step - warmup) / max(1, max_steps - warmup)
    min_lr = base_lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (base_lr - min_lr)
