"""The optim group (conf/optim/): torch.optim optimizers built from it. The artifacts engine bakes the same
settings into ORT's optimizer graph (ortflow/accel/artifacts.py)."""

import torch

from ortflow.config import OptimConfig, OptimName


def build_torch_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim optimizer for `cfg` (the hyperparameters the artifacts engine bakes into its graph)."""
    if cfg.name == OptimName.adamw:
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
