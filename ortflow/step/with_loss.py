"""The model and its loss as one module: what every engine trains (ORTModule runs the loss inside ORT too)."""

import torch
from torch import nn

from ortflow.step.batch import Layout
from ortflow.step.loss import Loss


class WithLoss(nn.Module):
    """Model plus loss in one module, so ORTModule runs the loss inside ORT too. It takes the flat input tensors
    followed by the targets (batch.Layout) and calls the model with its inputs in their own structure.

    Training mode returns the loss only; eval mode returns (loss, output) for the metrics. With `autocast` (eager
    PyTorch in bf16-mixed) the model runs under torch's CPU autocast in bf16 and the loss is computed in fp32 on its
    output.
    """

    def __init__(self, model: nn.Module, loss: Loss, layout: Layout, autocast: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.layout = layout
        self.autocast = autocast

    def forward(self, *tensors: torch.Tensor):
        *inputs, targets = tensors
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            output = self.layout.call(self.model, tuple(inputs))
        if self.autocast and isinstance(output, torch.Tensor) and output.dtype == torch.bfloat16:
            output = output.float()
        loss = self.loss(output, targets)
        return loss if self.training else (loss, output)
