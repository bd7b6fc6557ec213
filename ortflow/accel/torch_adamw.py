"""The artifacts engine's AdamW graph with torch.optim.AdamW's conventions: ORT's AdamWOptimizer with adam_mode=0.

onnxruntime.training's `onnxblock.optim.AdamW` always builds ORT's AdamWOptimizer with adam_mode=1, Hugging Face's
AdamW, which differs from torch.optim.AdamW (what eager and ORTModule step with) in two places:
- eps: torch adds it to sqrt(v / (1 - beta2^t)), adam_mode=1 to sqrt(v), folding both bias corrections into the
  step size. In torch's terms adam_mode=1's eps is eps / sqrt(1 - beta2^t): 32x larger at the first step (beta2
  0.999). A weight whose gradient is near eps (rounding noise: a bias before a BatchNorm, a dead unit's weights)
  moves by about lr in torch and by less in adam_mode=1;
- weight decay: torch decays the weight before the update, adam_mode=1 after it.
Measured with `ortflow-check` (5 steps, batch 8, digits upscaled to 3x32x32): the artifacts engine's loss was 1.5e-3
from eager's on SqueezeNet 1.1, 4.6e-4 on MobileNetV3-small and 1.6e-3 on an LR-ASPP segmenter, where ORTModule's was
1e-7 to 1.3e-6 and eager's own runs from one-ulp weights moved it by 6e-4, 2e-5 and 3e-6. ORT's kernel has torch's
conventions as adam_mode=0 (weight decay first, eps added to sqrt(v / (1 - beta2^t)), the step lr / (1 - beta1^t));
with it the artifacts engine's losses are 1e-7 to 1e-6 from eager's on the same models.
"""

from typing import Any


def adamw_block(betas: tuple[float, float], eps: float, weight_decay: float, clip: Any = None) -> Any:
    """onnxblock's AdamW (with the gradient clipping block `clip`, or none) building ORT's AdamWOptimizer with
    adam_mode=0. Imports onnxruntime.training (call after the version checks: versions.prepare)."""
    from onnxruntime.training import onnxblock
    from onnxruntime.training.onnxblock.optim import optim

    class TorchConventions(optim.AdamWOptimizer):
        def _build_optimizer_node(self, inputs: list[str], output: str, node: str, attributes: dict) -> str:
            return super()._build_optimizer_node(inputs, output, node, {**attributes, "adam_mode": 0})

    block = onnxblock.optim.AdamW(betas=betas, eps=eps, weight_decay=weight_decay, clip_grad=clip)
    block._adamw = TorchConventions(bias_correction=True, betas=betas, eps=eps, weight_decay=weight_decay)
    return block
