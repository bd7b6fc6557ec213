"""Whether a model's outputs depend on the other samples of its batch, and through which layers.

The known, legitimate dependence is batch statistics: BatchNorm normalises with the batch's mean and variance in
training (and in evaluation too when it keeps no running statistics, `track_running_stats=False`), and InstanceNorm
with `track_running_stats=True` averages its per-sample statistics over the batch into its running statistics.
Such a model trains correctly as long as no padded rows join its batches (ortflow/data/short_batches.py sees to
that). Any other interaction between samples in evaluation mode is a contract violation, usually a sequence-first
layer fed batch-first data (model/contract.py refuses it).

The probe changes one sample of a batch and measures how far the other samples' outputs move, in evaluation mode
with the batch-statistics layers held at fixed statistics (so only other interactions can move them). Training-mode
dependence is read from the layers' types, not probed: a training forward has effects a probe cannot undo in a
user's model (a call counter, a step schedule, an EMA kept in Python attributes).
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BATCH_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)
INSTANCE_NORMS = (
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
)

# Differences below this (relative to the outputs' scale) count as rounding, not as samples interacting.
MIX_TOLERANCE = 1e-4
_SHOWN = 8  # layer names kept in the record


@dataclass(frozen=True)
class BatchDependence:
    """How a model depends on the other samples of a batch.

    Attributes:
        training: layers whose training-mode outputs or running statistics use the whole batch (BatchNorm, and
            InstanceNorm with track_running_stats=True).
        eval: layers that normalise with the batch's statistics in evaluation mode too (BatchNorm with
            track_running_stats=False).
    """

    training: tuple[str, ...] = ()
    eval: tuple[str, ...] = ()

    @property
    def in_training(self) -> bool:
        return bool(self.training)

    @property
    def in_eval(self) -> bool:
        return bool(self.eval)

    def describe(self) -> str:
        """One phrase for logs: which layers make the model depend on its batch, and when."""
        if self.eval:
            return f"{_names(self.eval)} normalise with the batch's statistics in training and evaluation"
        if self.training:
            return f"{_names(self.training)} use the batch's statistics in training"
        return "its outputs do not depend on other samples of the batch"

    def record(self) -> dict[str, Any]:
        """For run.json: the facts, with at most a few layer names."""
        return {
            "in_training": self.in_training,
            "in_eval": self.in_eval,
            "layers": len(self.training),
            "first_layers": list(self.training[:_SHOWN]),
        }


def _names(layers: tuple[str, ...]) -> str:
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return f"{len(layers)} batch-statistics layer(s) ({shown})"


def known_layers(model: nn.Module) -> BatchDependence:
    """The model's batch-statistics layers, found by type (subclasses included, e.g. timm's BatchNormAct2d)."""
    training, evaluation = [], []
    for name, module in model.named_modules():
        label = name or type(module).__name__
        if isinstance(module, BATCH_NORMS):
            training.append(label)
            if module.running_mean is None:  # track_running_stats=False: batch statistics in evaluation too
                evaluation.append(label)
        elif isinstance(module, INSTANCE_NORMS) and module.track_running_stats:
            training.append(label)
    return BatchDependence(tuple(training), tuple(evaluation))


@contextlib.contextmanager
def fixed_statistics(model: nn.Module, layers: tuple[str, ...]) -> Iterator[None]:
    """The named BatchNorm layers (ones without running statistics) normalise with mean 0 and variance 1 instead of
    the batch's, so that a probe sees only other interactions between samples; afterwards they are as they were."""
    modules = [m for name, m in model.named_modules() if (name or type(m).__name__) in layers]
    for m in modules:
        dtype = m.weight.dtype if m.weight is not None else torch.get_default_dtype()
        m.running_mean = torch.zeros(m.num_features, dtype=dtype)
        m.running_var = torch.ones(m.num_features, dtype=dtype)
    try:
        yield
    finally:
        for m in modules:
            m.running_mean = None
            m.running_var = None


def changed_first_sample(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The batch with sample 0 replaced (by sample 1, or sample 0 shifted when the two are equal)."""
    probe = []
    for t in tensors:
        changed = t.clone()
        changed[0] = t[1] if not torch.equal(t[0], t[1]) else _perturbed(t[0])
        probe.append(changed)
    return tuple(probe)


def _perturbed(sample: torch.Tensor) -> torch.Tensor:
    if sample.is_floating_point():
        return sample + 1.0
    return (sample + 1) % max(int(sample.max()) + 1, 2)


def others_moved(
    call: Callable[[tuple[torch.Tensor, ...]], Any], tensors: tuple[torch.Tensor, ...], out: Any = None
) -> bool:
    """Whether changing sample 0 moves the other samples' outputs beyond rounding. `call` maps input tensors to the
    model's output (`out`: its output on `tensors`, when already computed)."""
    out = call(tensors) if out is None else out
    probe = call(changed_first_sample(tensors))
    moved = (probe[1:] - out[1:]).abs().max()
    return bool(moved > MIX_TOLERANCE * out[1:].abs().max().clamp_min(1.0))


def moves_in_eval(
    model: nn.Module, call: Callable, tensors: tuple[torch.Tensor, ...], out: torch.Tensor, known: BatchDependence
) -> bool:
    """Whether samples interact in evaluation mode other than through the known batch-statistics layers (`out`: the
    eval-mode output on `tensors`)."""
    if not known.eval:
        return others_moved(call, tensors, out)
    with fixed_statistics(model, known.eval):
        return others_moved(call, tensors)
