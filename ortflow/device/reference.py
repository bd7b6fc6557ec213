"""The same steps as a device takes, in eager PyTorch fp32: the reference the torch-free check is held to.

ORT's optimizer graphs are reproduced as ORT computes them, not as torch.optim does:
- AdamW is ORT's `AdamWOptimizer` with adam_mode=1 (Hugging Face's AdamW, what onnxblock.optim.AdamW builds):
  the bias correction goes into the step size, lr * sqrt(1 - beta2^t) / (1 - beta1^t), eps is added to sqrt(v)
  uncorrected, and the weight decay p -= lr * weight_decay * p comes after the update (torch.optim.AdamW decays
  first and corrects v before adding eps);
- SGD is `SGDOptimizerV2`: p -= lr * g;
- gradient clipping is ORT's InplaceClipGradNorm, the same as torch.nn.utils.clip_grad_norm_.
The learning rate is the float32 product ORT's optimizer model computes (portable.RUNTIME_LR times the set's scale).

BatchNorm: torch's own buffers after the steps give the running means; the running variances a device keeps are
ORT's, updated with the *biased* batch variance, so they are tracked beside torch's (BiasedRunningVariance).
"""

import copy
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ortflow.config import OptimConfig, OptimName
from ortflow.step import clipping
from ortflow.step.batch import Inputs, Layout
from ortflow.step.loss import Loss


@dataclass
class FirstStep:
    """What the first step (same weights, same batch on both sides) leaves: each trainable parameter's gradient
    (before clipping), and every parameter and running statistic after the update, by torch name."""

    gradients: dict[str, np.ndarray] = field(default_factory=dict)
    parameters: dict[str, np.ndarray] = field(default_factory=dict)
    statistics: dict[str, np.ndarray] = field(default_factory=dict)  # "layer.running_mean" / "layer.running_var"


@dataclass
class Reference:
    losses: list[float]
    eval_loss: float
    parameters: dict[str, np.ndarray]  # torch names -> values after the steps
    running_mean: dict[str, np.ndarray] = field(default_factory=dict)  # BatchNorm layer -> torch's buffer
    running_var_biased: dict[str, np.ndarray] = field(default_factory=dict)  # ... with the biased batch variance
    running_var_torch: dict[str, np.ndarray] = field(default_factory=dict)  # ... torch's buffer (unbiased update)
    first: FirstStep = field(default_factory=FirstStep)
    initial_statistics: dict[str, np.ndarray] = field(default_factory=dict)  # the running statistics before step 1


class BiasedRunningVariance:
    """Beside each tracking BatchNorm's own buffers, the running variance updated as ORT's kernel updates it: with
    the batch's biased variance, at the layer's momentum (in double precision, as torch's CPU kernel)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats}
        self.values = {n: m.running_var.detach().double().clone() for n, m in self.layers.items()}
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.layers.items()]

    def _hook(self, name: str):
        def update(module: _BatchNorm, args: tuple) -> None:
            if not module.training:
                return
            x = args[0].detach().double()
            dims = [d for d in range(x.dim()) if d != 1]
            biased = x.var(dim=dims, unbiased=False)
            factor = float(module.momentum)  # None is refused before any export (export.refusals)
            self.values[name] = self.values[name] * (1 - factor) + biased * factor

        return update

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def float32_lr(scale: float, runtime_lr: float) -> float:
    """The learning rate ORT's optimizer graph computes: runtime_lr * scale, both float32."""
    return float(np.float32(runtime_lr) * np.float32(scale))


@torch.no_grad()
def _ort_step(
    params: list[torch.Tensor], moments: list[list[torch.Tensor]], optim: OptimConfig, lr: float, step: int
) -> None:
    if optim.name != OptimName.adamw:
        for p in params:
            p -= lr * p.grad
        return
    beta1, beta2 = (np.float32(b) for b in optim.betas)
    correction1 = np.float32(1.0) - np.float32(np.power(beta1, step, dtype=np.float64))
    correction2 = np.float32(1.0) - np.float32(np.power(beta2, step, dtype=np.float64))
    lr_corrected = float(np.float32(lr) * np.float32(np.sqrt(correction2)) / correction1)
    for p, (m, v) in zip(params, moments, strict=True):
        g = p.grad
        m.mul_(float(beta1)).add_(g, alpha=1 - float(beta1))
        v.mul_(float(beta2)).addcmul_(g, g, value=1 - float(beta2))
        p -= lr_corrected * m / (v.sqrt() + optim.eps)
        p -= lr * optim.weight_decay * p


def eager_steps(
    model: nn.Module,
    layout: Layout,
    batch: tuple[Inputs, torch.Tensor],
    loss: Loss,
    optim: OptimConfig,
    lr: float,
    grad_clip: float | None,
    steps: int,
) -> Reference:
    """`steps` training steps on one batch from `model`'s weights (a copy: `model` is left as it was), then its
    loss in eval mode with the running variances a device keeps (the biased ones)."""
    model = copy.deepcopy(model).float().train()
    inputs, targets = batch
    tensors = layout.flatten(inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    moments = [[torch.zeros_like(p), torch.zeros_like(p)] for p in params]
    tracked = BiasedRunningVariance(model)
    initial = _statistics(tracked)
    first = FirstStep()
    losses = []
    try:
        for step in range(1, steps + 1):
            value = loss(layout.call(model, tensors), targets)
            value.backward()
            losses.append(value.item())
            if step == 1:
                first.gradients = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
            clipping.clip(params, grad_clip)
            _ort_step(params, moments, optim, lr, step)
            for p in params:
                p.grad = None
            if step == 1:
                first.parameters = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
                first.statistics = _statistics(tracked)
    finally:
        tracked.remove()
    torch_var = {n: m.running_var.numpy().copy() for n, m in tracked.layers.items()}
    with torch.no_grad():  # evaluated with the statistics a device keeps
        for name, module in tracked.layers.items():
            module.running_var.copy_(tracked.values[name])
    model.eval()
    with torch.no_grad():
        eval_loss = float(loss(layout.call(model, tensors), targets))
    return Reference(
        losses,
        eval_loss,
        {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
        {n: m.running_mean.numpy().copy() for n, m in tracked.layers.items()},
        {n: v.float().numpy() for n, v in tracked.values.items()},
        torch_var,
        first,
        initial,
    )


def _statistics(tracked: BiasedRunningVariance) -> dict[str, np.ndarray]:
    """The running statistics a device keeps, by their torch names: the means and the biased-variance updates."""
    found = {f"{n}.running_mean": m.running_mean.numpy().copy() for n, m in tracked.layers.items()}
    found |= {f"{n}.running_var": v.float().numpy().copy() for n, v in tracked.values.items()}
    return found


def replayed_update(
    model: nn.Module, gradients: dict[str, np.ndarray], optim: OptimConfig, lr: float, grad_clip: float | None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The first update ORT's optimizer graph makes from `model`'s weights with the given gradients (a device's own),
    clipping included: each trainable parameter before and after it, by torch name."""
    named = [(n, p.detach().float().clone()) for n, p in model.named_parameters() if n in gradients]
    before = {name: p.numpy().copy() for name, p in named}
    params = [p for _, p in named]
    for name, p in named:
        p.grad = torch.from_numpy(np.asarray(gradients[name], np.float32).reshape(p.shape).copy())
    clipping.clip(params, grad_clip)
    _ort_step(params, [[torch.zeros_like(p), torch.zeros_like(p)] for p in params], optim, lr, 1)
    return before, {name: p.numpy() for name, p in named}
