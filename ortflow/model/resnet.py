"""A small ResNet for small images (CIFAR-style: a 3x3 stem, no max-pool), with BatchNorm.

Stages of BasicBlocks (two 3x3 convolutions with BatchNorm, an identity or 1x1 projection shortcut) whose width
doubles and resolution halves from one stage to the next, then global average pooling and a linear classifier.
`blocks=[1, 1, 1]` and width 16 is an 8-layer ResNet of 78K parameters; He et al.'s CIFAR ResNet-20 is
`blocks=[3, 3, 3]`.
"""

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


class BasicBlock(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the shortcut, -> ReLU."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:  # projection where the shape changes
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """(B, in_channels, H, W) images -> (B, num_classes) logits."""

    def __init__(self, num_classes: int, in_channels: int, width: int, blocks: list[int]) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages, channels = [], width
        for i, count in enumerate(blocks):
            out = width * 2**i
            stride = 1 if i == 0 else 2  # halve the resolution from the second stage on
            stages += [BasicBlock(channels if j == 0 else out, out, stride if j == 0 else 1) for j in range(count)]
            channels = out
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))  # (B, C, H / 2**(stages-1), W / 2**(stages-1))
        return self.head(self.pool(x).flatten(1))  # (B, num_classes)


def build_resnet(num_classes: int, in_channels: int = 3, width: int = 16, blocks: list[int] | None = None) -> nn.Module:
    """Build a small ResNet.

    Args:
        num_classes: output logits.
        in_channels: channels of the input images (3 for RGB).
        width: channels of the first stage; each later stage doubles it.
        blocks: BasicBlocks per stage (default [1, 1, 1]: three stages of one block).

    Returns:
        The model, mapping (B, in_channels, H, W) float images to (B, num_classes) logits.
    """
    blocks = list(blocks) if blocks is not None else [1, 1, 1]
    model = ResNet(num_classes, in_channels, width, blocks)
    params = sum(p.numel() for p in model.parameters())
    log.info("built ResNet: width %d, blocks %s, %d classes (%d parameters)", width, blocks, num_classes, params)
    return model
