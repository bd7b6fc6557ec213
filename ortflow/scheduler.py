"""Learning-rate schedule as a pure function of the step: every engine gets the same value via set_lr."""

import math

from ortflow.config import SchedulerConfig, SchedulerName


def lr_at(step: int, base_lr: float, cfg: SchedulerConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Linear warmup over `warmup_steps`, then constant, or cosine decay to `min_lr_ratio * base_lr` at max_steps.
    """
    if step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    if cfg.name == SchedulerName.constant:
        return base_lr
    progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    min_lr = base_lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (base_lr - min_lr)
