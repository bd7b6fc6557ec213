"""The first update an engine applied, against torch's optimizer replayed on the engine's own step-1 gradients.

The gradients are read before clipping (capture.py); torch.nn.utils.clip_grad_norm_ (trainer.grad_clip) and the
torch.optim optimizer eager steps with (optim=..., ortflow/step/optim.py) are applied to them from the weights the
engine started from, in fp32, and the result is compared with the weights the engine holds after its first step. The
same formula computed in another order differs by a few ulps of the weight; a different optimizer (another AdamW
convention, a learning rate, weight decay or clipping not the config's) by far more, whatever the gradients were.
The worst element, in ulps of the weight (before or after the update, the larger), is the measure: it does not
depend on the weights' scale or the update's.
"""

import numpy as np
import torch

from ortflow.config import OptimConfig
from ortflow.step import clipping
from ortflow.step.optim import build_torch_optimizer

ULPS = 64  # an element of the first update this many ulps of its weight from torch's optimizer's result differs


def replayed(
    before: dict[str, np.ndarray], gradients: dict[str, np.ndarray], optim: OptimConfig, grad_clip: float | None
) -> dict[str, np.ndarray]:
    """The parameters after torch's optimizer step from `before` with `gradients` (clipped as a run clips them)."""
    names = [n for n in gradients if n in before]
    params = [torch.nn.Parameter(torch.from_numpy(np.array(before[n], np.float32))) for n in names]
    for p, name in zip(params, names, strict=True):
        p.grad = torch.from_numpy(np.array(gradients[name], np.float32))
    clipping.clip(params, grad_clip)
    build_torch_optimizer(params, optim).step()
    return {n: p.detach().numpy() for n, p in zip(names, params, strict=True)}


def ulps(got: np.ndarray, want: np.ndarray, before: np.ndarray) -> float:
    """The largest |got - want|, in ulps (float32) of the larger of the weight before and after the update: the
    scale at which the update's own rounding happens (a weight the update nearly cancels keeps the ulp of its
    operands)."""
    scale = np.maximum(np.abs(np.asarray(before, np.float32)), np.abs(np.asarray(want, np.float32)))
    spacing = np.spacing(np.maximum(scale, np.finfo(np.float32).tiny)).astype(np.float64)
    error = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return float(np.max(error / spacing, initial=0.0))


def differences(
    before: dict[str, np.ndarray],
    after: dict[str, np.ndarray],
    gradients: dict[str, np.ndarray],
    optim: OptimConfig,
    grad_clip: float | None,
) -> dict[str, float]:
    """Per parameter: the worst element of the engine's first update, in ulps of the weight, from torch's replay."""
    expected = replayed(before, gradients, optim, grad_clip)
    return {name: ulps(after[name], want, before[name]) for name, want in expected.items() if name in after}
