"""The artifacts engine's AdamW by torch's fused kernel, stepping ORT's own parameter and gradient buffers in place.

ORT 1.19's CPU AdamWOptimizer runs the update as a handful of single-threaded Eigen passes over each tensor: 42.7 ms
of a d_model 512 step (12.7M parameters) under ORT's profiler, where torch.optim.AdamW(fused=True) takes 11.3 ms for
the same update (2-core Intel Xeon). The training API keeps every weight and gradient in its CheckpointState; their
buffers are shared with torch over DLPack (no copy), so torch's optimizer steps them where ORT reads them on the next
run. The update is torch.optim.AdamW's, the one eager and ORTModule step with (the ORT graph's adam_mode=0 has the
same conventions: torch_adamw.py), clipping is eager's (step/clipping.py: clip_with_norm, with the norm the engine
computed).

The moments live in torch's optimizer, not in ORT's state: a checkpoint carries them as eager's and ORTModule's
checkpoints do (torch's state_dict), so a run moves between these engines with its moments. One written by ORT's
optimizer graph (`optim.fused=false`, or an earlier ortflow) resumes with fresh moments, as between other runtimes.
"""

from typing import Any

from torch import nn

from ortflow.accel.compat.ort import buffer_view
from ortflow.config import OptimConfig
from ortflow.step import clipping
from ortflow.step.optim import build_torch_optimizer, load_saved_state, saved_state


class BufferAdamW:
    """torch.optim.AdamW (fused) over the parameters `names` of an `api.CheckpointState`, with ORT's Optimizer's
    interface as the engine uses it (step, set_learning_rate, get_learning_rate)."""

    def __init__(self, state: Any, names: list[str], optim: OptimConfig, grad_clip: float | None, lr: float) -> None:
        self._state, self._names, self._grad_clip = state._state, names, grad_clip
        self._params = [nn.Parameter(buffer_view(self._state.get_parameter(n).data)) for n in names]
        self.optimizer = build_torch_optimizer(self._params, optim)
        self.set_learning_rate(lr)

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, norm: float) -> None:
        """One update from the gradients ORT holds now, clipped to trainer.grad_clip by their global norm `norm` (the
        engine's). The gradient buffers are left clipped; the engine resets them."""
        for param, name in zip(self._params, self._names, strict=True):
            grad = self._state.get_parameter(name).grad
            param.grad = buffer_view(grad) if grad.has_value() else None
        graded = [p for p in self._params if p.grad is not None]
        try:
            clipping.clip_with_norm(graded, self._grad_clip, norm)
            self.optimizer.step()
        finally:
            for param in self._params:
                param.grad = None  # the views die with the step: ORT may move its buffers on a new state

    def state(self) -> dict[str, Any]:
        return saved_state(self.optimizer)

    def load(self, state: dict[str, Any]) -> bool:
        return load_saved_state(self.optimizer, state)
