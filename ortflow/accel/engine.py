"""The Engine protocol (everything the loop needs, whichever runtime executes the model), the EngineContext an
engine is built from, and the loss/eval helpers every engine shares."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# Targets equal to this are padding: they carry no loss and no accuracy. Same value as torch's default.
IGNORE_INDEX = -100


@dataclass
class EvalResult:
    """Sums over one eval batch, so that batches of any size aggregate exactly."""

    loss_sum: float  # summed cross-entropy over counted targets
    correct: int  # counted targets whose argmax prediction is right
    count: int  # targets that are not IGNORE_INDEX

    def __add__(self, other: "EvalResult") -> "EvalResult":
        return EvalResult(self.loss_sum + other.loss_sum, self.correct + other.correct, self.count + other.count)


def _no_wrappers(module: nn.Module) -> nn.Module:
    return module


@dataclass
class EngineContext:
    """Everything the runner hands an engine builder besides the engine's own settings (conf/accel/<mode>.yaml).

    Attributes:
        model: the user's torch model, with its initial (or resumed) weights.
        example: one (inputs, targets) batch of the training batch size, taken without drawing from the training
            loader's generator (the data order stays the same in every accel mode).
        optim: the optim group (ortflow/optim.py); an engine either builds torch.optim from it or bakes it in.
        grad_clip: max global gradient norm, or None.
        debug: the debug group; an engine that cannot honour a debug option refuses it in its `problems`.
        onnx_dir: where the engine may write ONNX files (inside the run dir).
        wrap: the distributed wrappers (DDP) to apply around the engine's own module, outermost last.
        reduce_loss: turns this process's loss into the global one (the mean over ranks); None for one process.
    """

    model: nn.Module
    example: tuple[torch.Tensor, torch.Tensor]
    optim: Any
    grad_clip: float | None = None
    debug: Any = None
    onnx_dir: Path = field(default_factory=lambda: Path("onnx"))
    wrap: Callable[[nn.Module], nn.Module] = _no_wrappers
    reduce_loss: Callable[[float], float] | None = None

    @property
    def batch_size(self) -> int:
        return self.example[0].size(0)


class Engine(Protocol):
    """What the loop talks to. Built-in implementations: accel/none.py, accel/ortmodule.py, accel/artifacts.py."""

    name: str

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and optimizer step on one batch; returns the batch's mean loss.

        A NaN or infinite loss leaves the weights and the optimizer untouched (the step is not applied)."""
        ...

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        """Loss and accuracy sums on one batch, in eval mode, without touching the parameters."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights under the torch model's own state_dict names."""
        ...

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state as this engine keeps it, tagged {"format": "torch" | "onnxruntime", ...}."""
        ...

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        """Restore a state from optimizer_state(); False if it is the other runtime's format (the optimizer then
        starts fresh: torch.optim and ORT's optimizer graphs keep their moments in forms that do not convert)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What really executed so far (runtime, counts of ORT runs, fallbacks) for logs and metadata."""
        ...


def flat_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all positions: logits (B, ..., C), targets (B, ...)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)


class WithLoss(nn.Module):
    """Model plus loss in one module, so ORTModule runs the loss inside ORT too.

    Training mode returns the loss only; eval mode returns (loss, logits) for accuracy.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor):
        logits = self.model(inputs)
        loss = flat_cross_entropy(logits, targets)
        return loss if self.training else (loss, logits)


def eval_sums(loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> EvalResult:
    """Turn a batch's mean loss and logits into sums over the non-padding targets."""
    keep = targets != IGNORE_INDEX
    count = int(keep.sum())
    correct = int(((logits.argmax(-1) == targets) & keep).sum())
    return EvalResult(float(loss) * count, correct, count)


def pad_batch(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a short batch along dim 0 to `batch_size`: zero inputs, IGNORE_INDEX targets.

    ORT graphs are exported for the first batch's shape; a smaller last batch would hit shapes baked into the
    graph (a Reshape in nn.MultiheadAttention). Padded rows carry no loss, and samples do not interact across
    the batch dimension, so the mean loss over the real rows is unchanged.
    """
    missing = batch_size - inputs.size(0)
    if missing <= 0:
        return inputs, targets
    pad_in = inputs.new_zeros((missing, *inputs.shape[1:]))
    pad_tg = targets.new_full((missing, *targets.shape[1:]), IGNORE_INDEX)
    return torch.cat([inputs, pad_in]), torch.cat([targets, pad_tg])
