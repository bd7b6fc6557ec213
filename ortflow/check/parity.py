"""ortflow-check's parity verdict: an engine's losses against eager's own noise, gated on its step-1 gradients.

- Step 1 (same weights, same batch): the engine's gradients against eager's, as the relative L2 norm of the
  difference over every trainable parameter. Beyond GRADIENT_TOLERANCE (fp32), and beyond what eager's own step-1
  gradients move with one-ulp weights (the last point), the engine computes a different gradient: "differs",
  whatever happens later.
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
- Step-1 gradients beyond GRADIENT_TOLERANCE but within eager's own one-ulp runs' distance from eager's
  (`gradient_floor`, the largest of NOISE_SEEDS) are not a different gradient: the model's gradient is discontinuous
  at the scale of rounding. A ReLU input within rounding of 0 takes either side, and its gradient contribution comes
  or goes whole. torchvision regnet_y_400mf at 32x32, batch 8 (BatchNorm over 8 to 32 values in its last stages):
  eager fp32's pre-activations are up to 2e-4 (relative) from fp64's, one sits 8e-7 from 0, and each one-ulp seed
  flips two or three ReLU masks and moves eager's gradients by 5.0e-2 to 5.4e-2. ORTModule (1.5e-2 from eager) and
  the artifacts engine (2.3e-2) equal the fp64 gradient with one and two of those masks flipped, to 2.5e-4 and
  2.2e-4 (eager fp32: 2.0e-4). Such an engine is "within eager's own noise (ill-conditioned gradients: ...)", with
  the loss rules above; beyond the gradient floor it "differs" whatever the losses.

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
    """The verdict for one engine's row (`grad_rel_diff`, `max_rel_loss_diff`) against eager's noise floor: `floor`
    for the losses, and for the step-1 gradients max(GRADIENT_TOLERANCE, `gradient_floor`), eager's own step-1
    gradients with one-ulp weights against eager's (beyond the tolerance: an ill-conditioned gradient, said in the
    verdict). A bf16 row is held to eager bf16's own distance from eager fp32: `floor` and `gradient_tolerance` are
    that distance."""
    tolerance = GRADIENT_TOLERANCE if gradient_tolerance is None else max(gradient_tolerance, GRADIENT_TOLERANCE)
    grads, losses = row.get("grad_rel_diff"), row.get("max_rel_loss_diff")
    ill_conditioned = grads is not None and grads > tolerance and gradient_floor is not None and grads <= gradient_floor
    if grads is not None and not grads <= tolerance and not ill_conditioned:
        own = f"; {what}'s own with one-ulp weights: {gradient_floor:.1e}" if gradient_floor is not None else ""
        return f"differs: step-1 gradients {grads:.1e} from {what}'s (over {tolerance:.0e}{own})"
    if losses is None or floor is None:
        return "-"
    notes = []
    if ill_conditioned:
        notes.append(
            f"ill-conditioned gradients: step-1 {grads:.1e} from {what}'s, {what}'s own with one-ulp weights "
            f"{gradient_floor:.1e}"
        )
    chaotic = floor > CHAOTIC_FLOOR
    if losses <= max(floor, tolerance):
        notes = ["chaotic model", *notes] if chaotic else notes
        return f"within {what}'s own noise" + (f" ({'; '.join(notes)})" if notes else "")
    if chaotic and grads is not None:  # the step-1 gradients agreed: what follows is the model's own amplification
        notes = [f"chaotic model: loss {losses:.1e}, beyond the 3-seed floor", *notes]
        return f"within {what}'s own noise ({'; '.join(notes)})"
    return f"differs: loss {losses:.1e} beyond {what}'s own noise {floor:.1e}"
