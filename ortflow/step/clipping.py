"""Gradient clipping (trainer.grad_clip), the one place every engine calls. The norm is the global L2 norm of the
trainable gradients before clipping (logged as train/grad_norm; a non-finite one applies no step), and the gradients
are scaled by min(1, grad_clip / norm), torch.nn.utils.clip_grad_norm_'s formula, wherever they live:

- `clip_and_apply`: the eager engines (accel=none, ortmodule, compile; DeepSpeed's stage 0): torch's norm and clip on
  the parameters' `.grad`, then the optimizer's step where the norm is finite;
- `clip_with_norm`: the artifacts engine's fused AdamW on ORT's gradient buffers (accel/buffer_adamw.py), with the
  norm the engine computed already;
- `ort_clip_block`: the artifacts engine's optimizer graph, ORT's ClipGradNorm block (InplaceClipGradNorm, the same
  formula);
- `clip`: the references that replay torch's update on given gradients (ortflow-check, the device reference).
"""

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn


def clip_and_apply(parameters: Iterable[nn.Parameter], grad_clip: float | None, apply: Callable[[], Any]) -> float:
    """torch's global gradient norm of `parameters` (returned, before clipping), the gradients clipped to `grad_clip`
    (None: not clipped), then `apply()` (the optimizer's step) only where the norm is finite: a step of non-finite
    gradients applies nothing. With DDP, or DeepSpeed's stage 0, the gradients are all-reduced: every rank agrees."""
    limit = grad_clip if grad_clip is not None else math.inf
    norm = float(torch.nn.utils.clip_grad_norm_(parameters, limit))
    if math.isfinite(norm):
        apply()
    return norm


def clip_with_norm(parameters: Sequence[nn.Parameter], grad_clip: float | None, norm: float) -> None:
    """The `.grad` of `parameters` clipped to `grad_clip` (None: left as they are) by their global norm `norm`,
    computed beforehand."""
    if grad_clip is not None and parameters:
        torch.nn.utils.clip_grads_with_norm_(parameters, grad_clip, torch.tensor(norm))  # reads each .grad


def clip(parameters: Sequence[nn.Parameter], grad_clip: float | None) -> None:
    """The `.grad` of `parameters` clipped to `grad_clip` by their global norm (None: left as they are)."""
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)


def ort_clip_block(grad_clip: float | None) -> Any:
    """ORT's clipping block for an optimizer graph (onnxblock's ClipGradNorm), or None for no clipping."""
    if grad_clip is None:
        return None
    from onnxruntime.training import onnxblock

    return onnxblock.optim.ClipGradNorm(grad_clip)
