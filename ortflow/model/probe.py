"""Looking at a model's training-mode forward without training it."""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[nn.Module]:
    """`model`; afterwards its buffers (BatchNorm statistics a training forward updates) hold what they held."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])


@contextlib.contextmanager
def training_forward_probe(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in training mode under no_grad; afterwards its mode and its buffers (BatchNorm statistics a training
    forward updates) are as they were."""
    training = model.training
    model.train()
    try:
        with buffers_kept(model), torch.no_grad():
            yield model
    finally:
        model.train(training)
