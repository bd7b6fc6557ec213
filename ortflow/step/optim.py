"""The optim group (conf/optim/): torch.optim optimizers built from it, and their state as checkpoints hold it. The
artifacts engine steps the same AdamW on ORT's buffers (ortflow/accel/buffer_adamw.py), or bakes these settings into
ORT's optimizer graph (optim.fused=false, and SGD)."""

from typing import Any

import torch

from ortflow.config import OptimConfig, OptimName

FUSED_DEVICES = ("cpu", "cuda")  # where torch.optim.AdamW(fused=True) has a kernel in every supported torch


def build_torch_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim optimizer for `cfg` (the hyperparameters the artifacts engine bakes into its graph).

    AdamW takes torch's fused kernel (`optim.fused`) when every parameter is a floating-point tensor on a device that
    has it: the same update in one pass over each tensor instead of a dozen (12.7M parameters on a 2-core Xeon: 11 ms
    a step against 39 ms for torch's default loop)."""
    params = list(params)
    if cfg.name == OptimName.adamw:
        fusable = cfg.fused and all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params)
        return torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=True if fusable else None,
        )
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def restore_kernel_choice(optimizer: torch.optim.Optimizer) -> None:
    """After load_state_dict: step with the kernel this run chose (`optim.fused`), not the one the checkpoint's
    param_groups name (a run that wrote it with the other setting, or before ortflow chose)."""
    for group in optimizer.param_groups:
        if "fused" in group:
            group["fused"] = optimizer.defaults.get("fused")


def saved_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch.optim optimizer's state as a checkpoint holds it (eager, ORTModule, the artifacts engine's AdamW)."""
    return {"format": "torch", "state": optimizer.state_dict()}


def load_saved_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
    """`saved_state`'s dict into `optimizer`; False (nothing loaded) for state another runtime kept."""
    if state.get("format") != "torch":
        return False
    optimizer.load_state_dict(state["state"])
    restore_kernel_choice(optimizer)
    return True
