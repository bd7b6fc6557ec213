"""How the eager engines (accel=none, ortmodule, compile) apply one optimizer step: backward, the global gradient
norm and clipping, the optimizer's step, and the optimizer state for checkpoints. `TorchSteps` is torch's own;
distributed=deepspeed hands DeepSpeed's engine the module and the optimizer instead (ortflow/step/deepspeed.py).
An engine takes its steps from `EngineContext.steps`, so a wrapper that owns the optimizer fits without the engine
or the loop knowing which it is."""

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ortflow.config import OptimConfig
from ortflow.step.clipping import clip_and_apply
from ortflow.step.optim import build_torch_optimizer, load_saved_state, saved_state


class Steps(Protocol):
    """What an eager engine asks of its optimizer side."""

    module: nn.Module  # what a forward calls (the module given, or the wrapper that owns it)
    optimizer: Any  # what set_lr writes the learning rate into (param_groups)
    # True: a micro-batch's non-finite loss drops the step at once (the engine returns before its backward). False:
    # every micro-batch's backward must run (DeepSpeed counts them), and the step skips non-finite gradients itself.
    drops_at_nonfinite_loss: bool

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        """One micro-batch's backward, of `micro_batches` before the step (the gradients add up to the mean's)."""
        ...

    def step(self) -> float:
        """The global gradient norm before clipping; clipped to grad_clip and applied when finite, else nothing
        applied. The gradients are cleared either way."""
        ...

    def zero_grad(self) -> None: ...

    def state(self) -> dict[str, Any]:
        """The optimizer state, tagged {"format": ...}, for a checkpoint."""
        ...

    def load(self, state: dict[str, Any]) -> bool:
        """Restore `state()`; False if it is another format (the optimizer then starts fresh)."""
        ...

    def save_shards(self, directory: Path) -> None:
        """On every rank, before rank 0 writes a checkpoint: the state each rank keeps for itself (DeepSpeed's ZeRO
        partitions), into `directory`. Nothing for torch's optimizer, whose state every rank holds whole."""
        ...


StepsFactory = Callable[[nn.Module, OptimConfig, "float | None"], Steps]


class TorchSteps:
    """torch autograd and torch.optim over the module's trainable parameters (frozen ones, LoRA's base weights, get
    no optimizer state and no weight decay)."""

    drops_at_nonfinite_loss = True

    def __init__(self, module: nn.Module, optim: OptimConfig, grad_clip: float | None) -> None:
        self.module = module
        self.optimizer = build_torch_optimizer([p for p in module.parameters() if p.requires_grad], optim)
        self.grad_clip = grad_clip

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        (loss / micro_batches).backward()

    def step(self) -> float:
        norm = clip_and_apply(self.module.parameters(), self.grad_clip, self.optimizer.step)
        self.zero_grad()  # non-finite gradients: dropped, nothing applied
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return saved_state(self.optimizer)

    def load(self, state: dict[str, Any]) -> bool:
        return load_saved_state(self.optimizer, state)

    def save_shards(self, directory: Path) -> None:
        return None
