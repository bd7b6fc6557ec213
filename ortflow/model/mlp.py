"""A multi-layer perceptron classifier (used by the digits recipe)."""

import logging

from torch import nn

log = logging.getLogger(__name__)


def build_mlp(in_features: int, num_classes: int, hidden: list[int], dropout: float = 0.0) -> nn.Module:
    """Build Flatten -> [Linear -> ReLU -> Dropout] * len(hidden) -> Linear.

    Args:
        in_features: size of one flattened input sample.
        num_classes: number of output logits.
        hidden: widths of the hidden layers.
        dropout: dropout probability after each hidden layer.

    Returns:
        The model, mapping (B, ...) float inputs to (B, num_classes) logits.
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, num_classes))
    model = nn.Sequential(*layers)
    log.info("built MLP %s -> %d classes", [in_features, *hidden], num_classes)
    return model
