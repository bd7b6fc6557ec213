"""`model.freeze=[glob, ...]`: parameters that do not train, for any model.

A pattern matches a parameter by its name in `model.named_parameters()` (`features.0.weight`) or by the name of a
module holding it (`features`, `layer*`, `transformer.h.[01]`), with shell-style globs (fnmatch). Frozen parameters
get `requires_grad=False`: eager and ORTModule compute no gradient for them and torch.optim holds no state for them;
accel=artifacts lists them as frozen parameters of its training graph (no gradient, no optimizer state, no weight
decay). A BatchNorm layer whose parameters are all frozen is replaced by a FrozenBatchNorm (torchvision's
FrozenBatchNorm2d, any dimension): it keeps its running statistics and normalises with them in training too, as a
fixed affine map. The state_dict names stay the model's own.
"""

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ortflow.errors import ConfigError


class FrozenBatchNorm(nn.Module):
    """BatchNorm with fixed statistics and affine parameters: y = (x - running_mean) / sqrt(running_var + eps) *
    weight + bias over dim 1, in training as in evaluation. Keeps the BatchNorm's state_dict names."""

    def __init__(self, norm: _BatchNorm) -> None:
        super().__init__()
        self.num_features, self.eps = norm.num_features, norm.eps
        self.weight, self.bias = norm.weight, norm.bias  # frozen Parameters (or None without affine)
        self.register_buffer("running_mean", norm.running_mean)
        self.register_buffer("running_var", norm.running_var)
        self.register_buffer("num_batches_tracked", norm.num_batches_tracked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(self.running_var + self.eps)
        shift = -self.running_mean * scale
        if self.weight is not None:
            scale = scale * self.weight
            shift = shift * self.weight + self.bias
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * scale.reshape(shape) + shift.reshape(shape)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"


@dataclass
class ParameterCount:
    """Parameters of a model: all of them, and those that train (numbers of elements)."""

    total: int
    trainable: int

    @classmethod
    def of(cls, model: nn.Module) -> "ParameterCount":
        params = list(model.parameters())
        return cls(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "trainable": self.trainable, "frozen": self.total - self.trainable}


def _names(name: str) -> list[str]:
    """A parameter's name and the names of the modules holding it: a.b.weight -> [a.b.weight, a.b, a]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(candidate, p) for candidate in _names(name) for p in patterns)


def freeze(model: nn.Module, patterns: list[str]) -> nn.Module:
    """Freeze the parameters `patterns` match (model.freeze); returns `model`, changed in place.

    Raises:
        ConfigError: a pattern matches no parameter (a typo would train everything silently), every parameter is
            frozen (nothing would train), or a frozen BatchNorm has no running statistics to keep.
    """
    patterns = [str(p) for p in patterns]
    if not patterns:
        return model
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(matches(name, [pattern]) for name in names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ConfigError(
                f"model.freeze: the pattern {pattern!r} matches no parameter of the model ({type(model).__name__}: "
                f"{shown}). Patterns are globs over parameter names or the modules holding them, e.g. "
                "model.freeze=[features] or model.freeze=['layer[12].*']."
            )
    for name, param in model.named_parameters():
        if matches(name, patterns):
            param.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"model.freeze={patterns} freezes every parameter of the model: nothing would train. Leave the layers "
            "to train (the head, say) out of the patterns."
        )
    _freeze_batch_norms(model, patterns)
    return model


def _freeze_batch_norms(model: nn.Module, patterns: list[str]) -> None:
    """Replace each BatchNorm whose parameters are all frozen (without parameters: whose name a pattern matches)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, _BatchNorm):
            continue
        params = list(module.parameters())
        frozen = all(not p.requires_grad for p in params) if params else matches(name, patterns)
        if not frozen:
            continue
        if module.running_mean is None:
            raise ConfigError(
                f"model.freeze: the BatchNorm {name!r} is frozen but keeps no running statistics "
                "(track_running_stats=False), so it has none to normalise with. Leave it out of model.freeze."
            )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, FrozenBatchNorm(module))
