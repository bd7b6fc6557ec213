"""A model moved by one ulp: how far eager PyTorch's own results move when nothing changes but rounding, and the
distance both measure it by. ortflow-check (check/parity.py) and the device export's check (device/check.py) hold an
engine or a set to that noise."""

import math

import numpy as np
import torch
from torch import nn

NOISE_SEEDS = (0, 1, 2)  # eager's own noise: three runs, each from the weights moved by one ulp with one of these


def perturbed(model: nn.Module, seed: int, precision: torch.dtype = torch.float32) -> nn.Module:
    """`model` with every floating-point parameter moved by one ulp of `precision` (the weights' own dtype, or
    bfloat16 where the model computes in it), up or down at random (in place; pass a fresh model)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point():
                up = torch.rand(parameter.shape, generator=generator) < 0.5
                direction = torch.where(up, math.inf, -math.inf).to(precision)
                if precision == parameter.dtype:
                    parameter.copy_(torch.nextafter(parameter, direction.to(parameter.dtype)))
                else:  # one ulp of `precision` at the weight's magnitude, added to the weight itself
                    rounded = parameter.to(precision)
                    step = torch.nextafter(rounded, direction).to(parameter.dtype) - rounded.to(parameter.dtype)
                    parameter.add_(step)
    return model


def gradient_scales(gradients: dict[str, np.ndarray], floor: float) -> dict[str, float]:
    """Each gradient's L2 norm, floored at `floor` x the norm a tensor of its size has at its module's typical entry
    (the RMS over every finite entry of the gradients of the parameters beside it: a conv's weight for its bias): what
    a difference in it is measured against. A gradient that is rounding noise by itself (a conv bias before a
    BatchNorm, zero in exact arithmetic) is so judged against the scale of the gradients it sits among, not its own
    near-zero size; the module's, not the whole model's, so that a layer with huge gradients elsewhere hides
    nothing."""
    sums: dict[str, list[float]] = {}
    for name, g in gradients.items():
        g = np.asarray(g, np.float64)
        if np.all(np.isfinite(g)):
            total = sums.setdefault(name.rpartition(".")[0], [0.0, 0.0])
            total[0] += float(np.sum(np.square(g)))
            total[1] += g.size
    scales = {}
    for name, g in gradients.items():
        squares, count = sums.get(name.rpartition(".")[0], [0.0, 0.0])
        rms = math.sqrt(squares / count) if count else 0.0
        g = np.asarray(g, np.float64)
        scales[name] = max(float(np.linalg.norm(g)), floor * rms * math.sqrt(g.size))
    return scales


def scaled(got: np.ndarray, want: np.ndarray, scale: float) -> float:
    """||got - want|| / scale in float64 (0 when both are equal, inf when the shapes differ or nothing is finite)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf
    diff = float(np.linalg.norm(got - want))
    if not math.isfinite(diff):
        return math.inf
    if scale > 0:
        return diff / scale
    return 0.0 if diff == 0 else math.inf


def relative(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are 0, inf when only `want` is)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf
    diff, norm = float(np.linalg.norm(got - want)), float(np.linalg.norm(want))
    if norm > 0:
        return diff / norm
    return 0.0 if diff == 0 else math.inf
