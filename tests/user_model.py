"""A model a user brings: referenced as model._target_=tests.user_model.build_model, never registered."""

from torch import nn


def build_model(vocab_size: int, d_model: int, **_ignored) -> nn.Module:
    """Embedding + linear: the transformer config's keys arrive as keyword arguments."""
    return nn.Sequential(nn.Embedding(vocab_size, d_model), nn.Linear(d_model, vocab_size))


def build_bigram(vocab_size: int, width: int) -> nn.Module:
    """Used with model=custom, whose keys are whatever the user adds."""
    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))
