"""What the check reads of an engine's first training step, at the same point in every engine: each trainable
parameter's gradient after the backward and before clipping and the optimizer, and the floating-point buffers the
step's forward changed (BatchNorm's running statistics).

- Engines stepped by torch.optim (eager; ORTModule, whose gradients torch's autograd accumulates into `.grad`): a
  post-accumulate-grad hook on each trainable parameter reads its gradient when the backward has accumulated it,
  before `clip_grad_norm_` and the optimizer's step. A parameter the backward gives no gradient has none here.
- The artifacts engine: ORT keeps the gradients in its checkpoint state's buffers; they are read when the engine
  calls its optimizer graph (which clips, then steps), so after the backward and before clipping.
- Any other engine: no gradients (the check says so).

The trainable parameters are read before and after the step too: the first update, which the check holds to torch's
optimizer replayed on the engine's own gradients (update.py).

The step itself is the engine's own `train_step`: nothing runs twice, so a forward that updates state (BatchNorm)
does so once, as in a run.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ortflow.accel.engine import OrtState, TorchStepped, UserModel, Wraps


@dataclass
class StepOne:
    """The first step's gradients (None: the engine offers none), the buffers after it, and the trainable parameters
    before and after it, by torch name."""

    gradients: dict[str, np.ndarray] | None = None
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    before: dict[str, np.ndarray] = field(default_factory=dict)
    after: dict[str, np.ndarray] = field(default_factory=dict)


class _ReadBeforeStep:
    """The artifacts engine's optimizer (ORT's graph, or torch's fused AdamW on ORT's buffers) reading the gradients
    ORT holds before each step."""

    def __init__(self, optimizer: Any, read: Callable[[], None]) -> None:
        self._optimizer, self._read = optimizer, read

    def step(self, *args: Any) -> None:
        self._read()
        self._optimizer.step(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def _torch_model(engine: Any) -> tuple[nn.Module, Any] | None:
    """The user's model and the torch optimizer of an engine stepped by torch.optim (eager, ORTModule's inner)."""
    inner = engine.inner if isinstance(engine, Wraps) else engine
    if not isinstance(inner, TorchStepped):
        return None
    model, optimizer = inner.model, inner.optimizer
    if isinstance(model, nn.Module) and isinstance(optimizer, torch.optim.Optimizer):
        return model, optimizer
    return None


def step_one(engine: Any, step: Callable[[], float]) -> tuple[float, StepOne]:
    """Run `step()` (the engine's first training step) and read its gradients and the buffers after it."""
    captured: dict[str, np.ndarray] = {}
    restore: Callable[[], None] = lambda: None  # noqa: E731
    gradients: dict[str, np.ndarray] | None = captured
    if (torch_engine := _torch_model(engine)) is not None:
        model = torch_engine[0]

        def reader(name: str) -> Callable[[torch.Tensor], None]:
            def read(parameter: torch.Tensor) -> None:
                if name not in captured and parameter.grad is not None:
                    captured[name] = parameter.grad.detach().float().cpu().numpy().copy()

            return read

        handles = [
            p.register_post_accumulate_grad_hook(reader(name))
            for name, p in model.named_parameters()
            if p.requires_grad
        ]
        restore = lambda: [h.remove() for h in handles]  # noqa: E731
    elif isinstance(engine, OrtState):
        prefix = "model."  # the artifacts engine's graph names: the user's model under `.model`
        optimizer = engine.optimizer

        def read_state() -> None:
            if not captured:
                for name in engine.trainable:
                    captured[name.removeprefix(prefix)] = np.array(engine.state.parameters[name].grad, np.float32)

        engine.optimizer = _ReadBeforeStep(optimizer, read_state)

        def restore() -> None:
            engine.optimizer = optimizer
    else:
        gradients = None
    before = parameters(engine)
    try:
        loss = step()
    finally:
        restore()
    return loss, StepOne(gradients, buffers(engine), before, parameters(engine))


def _model(engine: Any) -> nn.Module | None:
    inner = engine.inner if isinstance(engine, Wraps) else engine
    model = inner.model if isinstance(inner, UserModel) else None
    return model if isinstance(model, nn.Module) else None


def parameters(engine: Any) -> dict[str, np.ndarray]:
    """The engine's trainable parameters as it holds them (ORT's own for the artifacts engine), by torch name."""
    model, state = _model(engine), engine.model_state_dict()
    names = [n for n, p in model.named_parameters() if p.requires_grad] if model is not None else []
    return {n: state[n].detach().float().cpu().numpy().copy() for n in names if n in state}


def buffers(engine: Any) -> dict[str, np.ndarray]:
    """The engine's model buffers (its state_dict less the parameters): BatchNorm's running statistics (as float64)
    and counters."""
    state, model = engine.model_state_dict(), _model(engine)
    # every name of a parameter, tied ones too (an output layer sharing the embedding's weight)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)} if model is not None else set()
    return {
        name: (value.detach().double() if value.is_floating_point() else value.detach()).cpu().numpy().copy()
        for name, value in state.items()
        if name not in names and isinstance(value, torch.Tensor)
    }
