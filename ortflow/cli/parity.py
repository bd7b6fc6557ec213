"""ortflow-check's parity verdict: an engine's losses against eager's own noise, gated on its step-1 gradients.

- Step 1 (same weights, same batch): the engine's gradients against eager's, as the relative L2 norm of the
  difference over every trainable parameter. Beyond GRADIENT_TOLERANCE (fp32) the engine computes a different
  gradient: "differs", whatever happens later.
- Later steps: training amplifies rounding differences, in some models (a ResNet at batch 8 with AdamW) by orders of
  magnitude within a few steps. The noise floor is eager against itself: every weight moved by one ulp (towards
  +inf or -inf at random; NOISE_SEEDS seeds), the same batches and steps; the floor is the largest relative loss
  difference any of them reached. An engine whose gradients agree and whose losses stay within
  max(floor, GRADIENT_TOLERANCE) of eager's is "within eager's own noise"; a model whose floor exceeds
  CHAOTIC_FLOOR is called chaotic (its loss after a few steps depends on the last bit of its weights).
- A chaotic model whose step-1 gradients agree is "within eager's own noise" even where its later losses pass the
  floor: ORT's arithmetic differs from eager's by more than one ulp per op, the amplification is exponential, and
  three seeds sample a heavy-tailed spread (torchvision resnet18, 5 steps at batch 8: floors 3.8e-2 to 5.4e-2 on two
  datasets, the engines 1.4e-2 to 8.4e-2, step-1 gradients 4.5e-6 from eager's). The row says so.
- The one-ulp runs' step-1 gradients against eager's are reported too (`gradient_floor`): where an engine's
  gradients differ, it tells an ill-conditioned model (eager's own gradients move with the last bit of its weights)
  from a wrong gradient. The verdict stays "differs" either way.

Rows are plain dicts keyed by engine (`mode`); a row may carry more keys (a precision) without changing this.
"""

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

GRADIENT_TOLERANCE = 1e-4  # relative, fp32
CHAOTIC_FLOOR = 1e-2  # a 1-ulp perturbation moving the loss by more than 1% within the checked steps
NOISE_SEEDS = (0, 1, 2)


def perturbed(model: nn.Module, seed: int) -> nn.Module:
    """`model` with every floating-point parameter moved by one ulp, up or down at random (in place; pass a copy)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point():
                up = torch.rand(parameter.shape, generator=generator) < 0.5
                direction = torch.where(up, math.inf, -math.inf).to(parameter.dtype)
                parameter.copy_(torch.nextafter(parameter, direction))
    return model


def capture_step_one(engine: Any, batch: tuple[Any, torch.Tensor]) -> Callable[[], dict[str, np.ndarray]]:
    """Arrange to capture the gradients of the engine's first training step; returns the function that hands them
    over after that step. The artifacts engine computes them in a forward/backward of its own (no update); the
    torch-optimizer engines (eager, ORTModule) are read just before their optimizer's first step."""
    if hasattr(engine, "gradients"):
        _, grads = engine.gradients(*batch)
        return lambda: grads
    inner = getattr(engine, "inner", engine)
    names = {id(p): name for name, p in inner.model.named_parameters() if p.requires_grad}
    captured: dict[str, np.ndarray] = {}

    def before_step(optimizer: torch.optim.Optimizer, *_args: Any) -> None:
        if captured:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in names and p.grad is not None:
                    captured[names[id(p)]] = p.grad.detach().cpu().numpy().copy()

    handle = inner.optimizer.register_step_pre_hook(before_step)

    def take() -> dict[str, np.ndarray]:
        handle.remove()
        return captured

    return take


def gradient_difference(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float | None:
    """||got - want|| / ||want|| over every parameter both have (float64); None if none."""
    common = [name for name in want if name in got]
    if not common:
        return None
    diff = sum(float(np.square(got[n].astype(np.float64) - want[n].astype(np.float64)).sum()) for n in common)
    norm = sum(float(np.square(want[n].astype(np.float64)).sum()) for n in common)
    return math.sqrt(diff) / math.sqrt(norm) if norm > 0 else math.sqrt(diff)


def verdict(
    row: dict[str, Any],
    floor: float | None,
    gradient_floor: float | None = None,
    *,
    gradient_tolerance: float | None = None,
    what: str = "eager",
) -> str:
    """The verdict for one engine's row (`grad_rel_diff`, `max_rel_loss_diff`) against eager's noise floor
    (`gradient_floor`: eager's own step-1 gradients with one-ulp weights, shown where the gradients differ). A bf16 row
    is held to eager bf16's own distance from eager fp32: `floor` and `gradient_tolerance` are that distance."""
    tolerance = GRADIENT_TOLERANCE if gradient_tolerance is None else max(gradient_tolerance, GRADIENT_TOLERANCE)
    grads, losses = row.get("grad_rel_diff"), row.get("max_rel_loss_diff")
    if grads is not None and not grads <= tolerance:
        own = f"; {what}'s own with one-ulp weights: {gradient_floor:.1e}" if gradient_floor is not None else ""
        return f"differs: step-1 gradients {grads:.1e} from {what}'s (over {tolerance:.0e}{own})"
    if losses is None or floor is None:
        return "-"
    chaotic = floor > CHAOTIC_FLOOR
    if losses <= max(floor, tolerance):
        return f"within {what}'s own noise" + (" (chaotic model)" if chaotic else "")
    if chaotic and grads is not None:  # the step-1 gradients agreed: what follows is the model's own amplification
        return f"within {what}'s own noise (chaotic model: loss {losses:.1e}, beyond the 3-seed floor)"
    return f"differs: loss {losses:.1e} beyond {what}'s own noise {floor:.1e}"
