"""`accel=ortmodule`: ORTModule runs forward and backward in ONNX Runtime; torch.optim updates the weights.

Fallback policy: ORTModule silently runs PyTorch when it cannot handle a model. With `accel.fallback=fail`
(default) ORT's fallback is disabled and every training step is also checked against ORT's own run counters,
so a step that did not execute in ORT stops the run. With `warn` fallbacks are allowed, logged and recorded.
"""

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ortflow.accel import compat
from ortflow.accel.eager import EagerEngine
from ortflow.accel.engine import EvalResult, WithLoss, pad_batch
from ortflow.accel.extensions import ensure_built
from ortflow.config import DebugConfig, Fallback, OptimConfig, ORTModuleAccelConfig
from ortflow.errors import OrtflowError, root_reason

log = logging.getLogger(__name__)


def wrap(module: nn.Module, accel: ORTModuleAccelConfig, debug: DebugConfig, onnx_dir: Path) -> nn.Module:
    """Wrap `module` with ORTModule configured from the accel and debug groups.

    ORTModule must be the innermost wrapper (DDP or DeepSpeed go around it, never inside).
    """
    ensure_built()
    compat.configure_ortmodule(
        fallback_allowed=accel.fallback == Fallback.warn,
        opset=accel.opset,
        intra_op_threads=accel.intra_op_threads,
        allow_spinning=accel.allow_spinning,
        rewrite_gathers=accel.rewrite_gathers,
    )
    compat.disable_transformer_fastpath()
    from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule

    save_path = ""
    if debug.save_onnx:
        onnx_dir.mkdir(parents=True, exist_ok=True)
        save_path = str(onnx_dir)
    options = DebugOptions(
        log_level=LogLevel[debug.log_level.value],
        save_onnx=debug.save_onnx,
        onnx_prefix=debug.onnx_prefix,
        save_path=save_path,
    )
    return ORTModule(module, options)


class ORTModuleEngine:
    """ORTModule-wrapped model + loss, stepped by torch.optim (through an EagerEngine)."""

    name = "ortmodule"

    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig,
        grad_clip: float | None,
        accel: ORTModuleAccelConfig,
        debug: DebugConfig,
        onnx_dir: Path,
        distribute: Callable[[nn.Module], nn.Module] | None = None,
        reduce_loss: Callable[[float], float] | None = None,
    ) -> None:
        """`distribute` wraps the ORTModule (e.g. in DDP): ORTModule stays the innermost wrapper."""
        self.fallback = accel.fallback
        self.module = wrap(WithLoss(model), accel, debug, onnx_dir)
        outer = distribute(self.module) if distribute else self.module
        self.inner = EagerEngine(outer, model, optim, grad_clip, reduce_loss)
        self.batch_size: int | None = None  # shape ORT's graphs were exported for (first training batch)
        self.ort_steps = 0
        self.torch_steps = 0
        self.ort_evals = 0
        self.torch_evals = 0

    def _run(self, step, inputs: torch.Tensor, targets: torch.Tensor):
        """Call `step`, turning ORTModule's "cannot run this model" exceptions into a clear user error."""
        from onnxruntime.training.ortmodule._fallback_exceptions import ORTModuleFallbackException

        try:
            return step(inputs, targets)
        except ORTModuleFallbackException as err:
            raise OrtflowError(
                f"ORTModule cannot run this model in ONNX Runtime ({root_reason(err)}). "
                "Set accel.fallback=warn to let PyTorch run it instead (recorded as executed_by=pytorch), "
                "or use accel=none."
            ) from err

    def _not_in_ort(self, what: str) -> None:
        message = (
            f"ORTModule did not execute the {what} in ONNX Runtime (PyTorch ran it instead). The log above "
            "shows ORT's reason. Set accel.fallback=warn to allow PyTorch fallback, or accel=none."
        )
        if self.fallback == Fallback.fail:
            raise OrtflowError(message)
        log.warning(message)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        if self.batch_size is None:
            self.batch_size = inputs.size(0)
        inputs, targets = pad_batch(inputs, targets, self.batch_size)
        before = compat.ORT_RUNS.snapshot()
        loss = self._run(self.inner.train_step, inputs, targets)
        if not math.isfinite(loss):
            return loss  # forward only (no backward ran); the loop decides whether to stop or skip
        after = compat.ORT_RUNS.snapshot()
        # Proof, not absence of an error: ORT's own training session ran both the forward and the backward.
        if after[0] > before[0] and after[1] > before[1]:
            self.ort_steps += 1
        else:
            self.torch_steps += 1
            self._not_in_ort("training step (forward and backward)")
        return loss

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        real = inputs.size(0)
        inputs, targets = pad_batch(inputs, targets, self.batch_size or real)
        before = compat.ORT_RUNS.inference
        result = self._run(self.inner.eval_step, inputs, targets)
        if compat.ORT_RUNS.inference > before:
            self.ort_evals += 1
        else:
            self.torch_evals += 1
            self._not_in_ort("evaluation forward")
        return result

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.model_state_dict()

    def optimizer_state(self) -> dict[str, Any]:
        return self.inner.optimizer_state()

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        return self.inner.load_optimizer_state(state)

    def describe(self) -> dict[str, Any]:
        executed = "onnxruntime" if self.torch_steps == 0 and self.ort_steps > 0 else "pytorch"
        if self.ort_steps and self.torch_steps:
            executed = "mixed"
        return {
            "engine": self.name,
            "executed_by": executed,
            "ort_train_steps": self.ort_steps,
            "torch_fallback_train_steps": self.torch_steps,
            "ort_eval_batches": self.ort_evals,
            "torch_fallback_eval_batches": self.torch_evals,
        }
