"""Models that fail in the ways a guard must catch, each as a builder for model=custom."""

import torch
from torch import nn


class InfiniteGradient(nn.Module):
    """A bigram model whose logits are scaled by sqrt(gate), gate a parameter at 0: the loss is finite (all logits 0,
    the loss is log(vocab)), but the gate's gradient is d sqrt(g)/dg at 0 = inf, so the global gradient norm is not
    finite. An update applied with it would make every weight NaN."""

    def __init__(self, vocab_size: int, width: int, gate_shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))
        self.gate = nn.Parameter(torch.zeros(gate_shape))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens) * torch.sqrt(self.gate)


def build_infinite_gradient(vocab_size: int, width: int, gate_shape: tuple[int, ...] = ()) -> nn.Module:
    """`+model.gate_shape=[1]`: the gate as a one-element vector (DeepSpeed cannot broadcast a 0-d parameter)."""
    return InfiniteGradient(vocab_size, width, tuple(gate_shape))


class NaNInEval(nn.Module):
    """Trains normally; its evaluation outputs are NaN (an eval path that breaks, e.g. a bad running statistic)."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.net(tokens)
        return logits if self.training else logits * float("nan")


def build_nan_in_eval(vocab_size: int, width: int) -> nn.Module:
    return NaNInEval(vocab_size, width)


class NaNUnderExport(nn.Module):
    """An MLP on the digits whose ONNX export differs from its eager forward (it checks
    `torch.onnx.is_in_onnx_export()`): the graph an ORT engine trains yields NaN logits, eager trains normally."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        return logits * float("nan") if torch.onnx.is_in_onnx_export() else logits


def build_nan_under_export(num_classes: int = 10) -> nn.Module:
    return NaNUnderExport(num_classes)


class ChaoticDoubledUnderExport(nn.Module):
    """An MLP on the digits whose hidden layer goes through sin(1e8 x): one ulp of any weight scrambles every step-1
    gradient (eager's own runs say nothing about an engine), and whose ONNX export doubles its logits: an ORT engine
    trains another model, which a check blind to it must not call "within"."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(64, 32), nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.last(torch.sin(1e8 * self.first(x)))
        return 2 * logits if torch.onnx.is_in_onnx_export() else logits


def build_chaotic_doubled_under_export(num_classes: int = 10) -> nn.Module:
    return ChaoticDoubledUnderExport(num_classes)
