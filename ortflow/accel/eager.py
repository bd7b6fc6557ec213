"""Torch autograd + torch.optim: the `none` engine, and the optimizer half of the `ortmodule` engine."""

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ortflow.accel.engine import EvalResult, WithLoss, eval_sums
from ortflow.config import OptimConfig, OptimName

log = logging.getLogger(__name__)


def build_torch_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim optimizer for `cfg` (same hyperparameters the artifacts engine bakes into its graph)."""
    if cfg.name == OptimName.adamw:
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


class EagerEngine:
    """Runs `module` (a WithLoss, possibly wrapped by ORTModule) with torch autograd and torch.optim."""

    name = "none"

    def __init__(
        self,
        module: nn.Module,
        model: nn.Module,
        optim: OptimConfig,
        grad_clip: float | None,
        reduce_loss: Callable[[float], float] | None = None,
    ) -> None:
        """
        Args:
            module: what is called with (inputs, targets); returns the loss in train mode (DDP may wrap it).
            model: the user's torch model inside `module` (owner of the state_dict names).
            optim: optimizer settings.
            grad_clip: max global grad norm, or None for no clipping.
            reduce_loss: turns this process's loss into the global one (the mean over ranks) before the step, so
                that every rank takes the same decision on a non-finite loss; None for one process.
        """
        self.module = module
        self.model = model
        self.optimizer = build_torch_optimizer(module.parameters(), optim)
        self.grad_clip = grad_clip
        self.reduce_loss = reduce_loss

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        optim: OptimConfig,
        grad_clip: float | None,
        distribute: Callable[[nn.Module], nn.Module] | None = None,
        reduce_loss: Callable[[float], float] | None = None,
    ) -> "EagerEngine":
        module = WithLoss(model)
        return cls(distribute(module) if distribute else module, model, optim, grad_clip, reduce_loss)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.module.train()
        loss = self.module(inputs, targets)
        value = loss.item() if self.reduce_loss is None else self.reduce_loss(loss.item())
        if not math.isfinite(value):
            return value  # no backward, no update: the weights stay the last good ones
        loss.backward()
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        self.module.eval()
        loss, logits = self.module(inputs, targets)
        return eval_sums(loss, logits, targets)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any]:
        return {"format": "torch", "state": self.optimizer.state_dict()}

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        if state.get("format") != "torch":
            return False
        self.optimizer.load_state_dict(state["state"])
        return True

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "executed_by": "pytorch"}
