"""Models on the digits (64 features, 10 classes) that stop a gradient the ways people write it, each a builder for
model=custom: the forward is the same in every engine, and only autograd's stop tells the engines' gradients from a
model that differentiates through it."""

import torch
from torch import nn


class TeacherBranch(nn.Module):
    """A head trained on features it may not change (a probe, a teacher's branch): head(h.detach()) + head2(h)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, width), nn.Tanh())
        self.head, self.head2 = nn.Linear(width, 10), nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h.detach()) + self.head2(h)


class StraightThrough(nn.Module):
    """Quantization-aware training's straight-through estimator: the forward rounds, the backward passes through."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(64, width), nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x) * 4
        q = h + (torch.round(h) - h).detach()
        return self.head(torch.tanh(q / 4))


class Codebook(nn.Module):
    """A VQ-VAE bottleneck: the nearest of a learned codebook's vectors, the straight-through estimator to the encoder,
    and the codebook and commitment losses (each stopping the other side's gradient), added to the logits through a
    fixed per-class weight (a constant offset would leave cross-entropy unchanged)."""

    def __init__(self, width: int = 16, codes: int = 8) -> None:
        super().__init__()
        self.encoder, self.head = nn.Linear(64, width), nn.Linear(width, 10)
        self.codebook = nn.Parameter(torch.randn(codes, width) * 0.5)
        self.register_buffer("weight", torch.linspace(-1.0, 1.0, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.encoder(x))
        index = torch.cdist(z, self.codebook).argmin(dim=1)
        quantized = self.codebook[index]
        codebook_loss = ((z.detach() - quantized) ** 2).mean(dim=1, keepdim=True)
        commitment = ((z - quantized.detach()) ** 2).mean(dim=1, keepdim=True)
        zq = z + (quantized - z).detach()
        return self.head(zq) + (codebook_loss + 0.25 * commitment) * self.weight


class NoGradBlock(nn.Module):
    """A scale computed under torch.no_grad() inside the forward from the features it scales (a normaliser that
    does not train the layers before it)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(64, width), nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.no_grad():
            scale = h.abs().mean(dim=1, keepdim=True) + 1.0
        return self.head(torch.tanh(h / scale))


class DetachedBuffer(nn.Module):
    """A detach of what carries no gradient (a buffer, as rotary caches and masks are): nothing to stop."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(64, width), nn.Linear(width, 10)
        self.register_buffer("mask", (torch.arange(width) % 3 != 0).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)) * self.mask.detach())


def teacher_branch() -> nn.Module:
    return TeacherBranch()


def straight_through() -> nn.Module:
    return StraightThrough()


def codebook() -> nn.Module:
    return Codebook()


def no_grad_block() -> nn.Module:
    return NoGradBlock()


def detached_buffer() -> nn.Module:
    return DetachedBuffer()
