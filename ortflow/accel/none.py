"""`accel=none`: eager PyTorch, torch autograd + torch.optim. EagerEngine is also the optimizer half of the
`ortmodule` engine (which hands it an ORTModule-wrapped module)."""

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from ortflow.accel.engine import EngineContext
from ortflow.config import BF16, OptimConfig
from ortflow.model import hooks, state_dict
from ortflow.step.batch import Inputs, Layout
from ortflow.step.loss import EvalResult, Loss
from ortflow.step.steps import StepsFactory, TorchSteps
from ortflow.step.with_loss import WithLoss

log = logging.getLogger(__name__)

NAME = "none"
TITLE = "eager PyTorch"  # the run header's "what executes it"
SIMPLICITY = 0  # eager PyTorch: the reference (accel=auto picks the simplest of equals)
EXECUTED_BY = "pytorch"  # describe()["executed_by"] when it ran as it should
RUNS_IN_STEP = frozenset(hooks.Kind)  # eager PyTorch runs every hook and state update


@dataclass
class Settings:
    """conf/accel/none.yaml: eager PyTorch has no settings of its own."""

    _target_: str = "ortflow.accel.none.build"


def debug_problems(cfg: DictConfig, name: str) -> list[str]:
    """The refusal shared by engines that have no ORTModule DebugOptions to honour."""
    if cfg.debug.save_onnx or cfg.debug.log_level.value != "WARNING":
        return [
            f"debug: the debug options are ORTModule's DebugOptions and apply to accel=ortmodule only, not "
            f"accel={name}; use debug=off (accel=artifacts always writes its ONNX files to <run dir>/onnx/)."
        ]
    return []


def problems(cfg: DictConfig) -> list[str]:
    return debug_problems(cfg, NAME)


def build(ctx: EngineContext) -> "EagerEngine":
    """The eager engine around `ctx.model` (with ctx's distributed wrappers around it)."""
    ctx.refuse_unrun(NAME, RUNS_IN_STEP)  # eager PyTorch runs every hook: nothing is refused
    module = ctx.wrap(WithLoss(ctx.model, ctx.loss, ctx.layout, autocast=ctx.precision == BF16))
    return EagerEngine(module, ctx.model, ctx.loss, ctx.layout, ctx.optim, ctx.grad_clip, ctx.reduce_loss, ctx.steps)


class EagerEngine:
    """Runs `module` (a WithLoss, possibly wrapped by ORTModule) with torch autograd and its optimizer side
    (torch.optim, or DeepSpeed's engine under distributed=deepspeed: ortflow/step/steps.py)."""

    name = NAME

    def __init__(
        self,
        module: nn.Module,
        model: nn.Module,
        loss: Loss,
        layout: Layout,
        optim: OptimConfig,
        grad_clip: float | None,
        reduce_loss: Callable[[float], float] | None = None,
        steps: StepsFactory = TorchSteps,
    ) -> None:
        """
        Args:
            module: what is called with (*input tensors, targets); returns the loss in train mode (DDP may wrap it).
            model: the user's torch model inside `module` (owner of the state_dict names).
            loss: the loss inside `module`; its `sums` score eval batches.
            layout: the structure of a batch's inputs.
            optim: optimizer settings.
            grad_clip: max global grad norm, or None for no clipping.
            reduce_loss: turns this process's loss into the global one (the mean over ranks) before the step, so
                that every rank takes the same decision on a non-finite loss; None for one process.
            steps: builds the optimizer side from (module, optim, grad_clip) (EngineContext.steps).
        """
        self.steps = steps(module, optim, grad_clip)
        self.module = self.steps.module
        self.model = model
        self.loss = loss
        self.layout = layout
        self.reduce_loss = reduce_loss
        self.last_grad_norm: float | None = None  # the global gradient norm of the last step, before clipping
        # Called once, after the next step's backward and before its update (ORTModule's first-step check reads the
        # step's gradients there); a step that stops at a non-finite loss leaves it set.
        self.before_update: Callable[[], None] | None = None

    @property
    def optimizer(self) -> Any:
        """The optimizer the step applies (ortflow-check reads the gradients through it, before its step)."""
        return self.steps.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Any) -> None:
        self.steps.optimizer = optimizer

    def train_step(self, inputs: Inputs, targets: torch.Tensor) -> float:
        return self.train_micro([(inputs, targets)])

    def train_micro(self, micro: Sequence[tuple[Inputs, torch.Tensor]]) -> float:
        """One optimizer step over the micro-batches: each one's loss / N is backpropagated (gradients add up to
        those of the mean loss over all of them), then the gradient norm (before clipping), clipping and the step.
        Returns the mean loss; a non-finite one, or gradients of a non-finite norm (last_grad_norm), drop the step's
        gradients and apply nothing."""
        self.module.train()
        losses = []
        for inputs, targets in micro:
            loss = self.module(*self.layout.flatten(inputs), targets)
            value = loss.item() if self.reduce_loss is None else self.reduce_loss(loss.item())
            losses.append(value)
            if not math.isfinite(value) and self.steps.drops_at_nonfinite_loss:
                self.steps.zero_grad()
                self.last_grad_norm = None
                return value  # no update: the weights stay the last good ones
            self.steps.backward(loss, len(micro))
        if self.before_update is not None:  # once: a wrapping engine's look at the step's gradients
            look, self.before_update = self.before_update, None
            look()
        self.last_grad_norm = self.steps.step()
        return sum(losses) / len(losses)

    @torch.no_grad()
    def eval_step(self, inputs: Inputs, targets: torch.Tensor) -> EvalResult:
        self.module.eval()
        _, output = self.module(*self.layout.flatten(inputs), targets)
        return self.loss.sums(output, targets)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return state_dict.copied(self.model)  # with the state_dict's metadata (module versions)

    def optimizer_state(self) -> dict[str, Any]:
        return self.steps.state()

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        return self.steps.load(state)

    def save_shards(self, directory: Path) -> None:
        """The state each rank keeps for itself (DeepSpeed's ZeRO partitions), on every rank before a checkpoint."""
        self.steps.save_shards(directory)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "executed_by": "pytorch"}
