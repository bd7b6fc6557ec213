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


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def dropout_probabilities(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Each (module, attribute) holding a dropout probability: nn.Dropout*'s and torchvision.ops' StochasticDepth's
    `p`, nn.MultiheadAttention's `dropout`."""
    found = []
    for module in model.modules():
        if isinstance(module, DROPOUTS) or type(module).__name__ == "StochasticDepth":
            found.append((module, "p"))
        if isinstance(module, nn.MultiheadAttention):
            found.append((module, "dropout"))
    return found


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with every dropout probability (`dropout_probabilities`) at 0; afterwards as they were."""
    kept = [(module, name, getattr(module, name)) for module, name in dropout_probabilities(model)]
    for module, name, _ in kept:
        setattr(module, name, 0.0)
    try:
        yield model
    finally:
        for module, name, value in kept:
            setattr(module, name, value)
