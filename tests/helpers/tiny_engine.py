"""A fourth engine, written as a user would: this one module plus tests/helpers/plugin/accel/tiny.yaml (on the search
path).

It trains with plain SGD written out by hand and counts its own steps, so a test can tell that it, and not a
built-in engine, ran."""

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from ortflow.accel.engine import EngineContext
from ortflow.step.batch import Layout
from ortflow.step.loss import EvalResult, Loss
from ortflow.step.with_loss import WithLoss

NAME = "tiny"


def problems(cfg: DictConfig) -> list[str]:
    return [] if cfg.optim.name.value == "sgd" else ["accel=tiny trains with SGD only; use optim=sgd."]


@dataclass
class TinyEngine:
    module: torch.nn.Module
    model: torch.nn.Module
    loss: Loss
    layout: Layout
    lr: float
    scale: float
    steps: int = 0
    name: str = NAME

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.module.train()
        loss = self.module(*self.layout.flatten(inputs), targets)
        loss.backward()
        with torch.no_grad():
            for p in self.module.parameters():
                p -= self.lr * self.scale * p.grad
                p.grad = None
        self.steps += 1
        return loss.item()

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        self.module.eval()
        _, output = self.module(*self.layout.flatten(inputs), targets)
        return self.loss.sums(output, targets)

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any]:
        return {"format": "tiny"}

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        return state.get("format") == "tiny"

    def describe(self) -> dict[str, Any]:
        return {"engine": NAME, "executed_by": "tiny", "tiny_steps": self.steps}


def build(ctx: EngineContext, scale: float = 1.0) -> TinyEngine:
    module = ctx.wrap(WithLoss(ctx.model, ctx.loss, ctx.layout))
    return TinyEngine(module, ctx.model, ctx.loss, ctx.layout, ctx.optim.lr, scale)
