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


def relative(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are 0, inf when only `want` is)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf
    diff, norm = float(np.linalg.norm(got - want)), float(np.linalg.norm(want))
    if norm > 0:
        return diff / norm
    return 0.0 if diff == 0 else math.inf
