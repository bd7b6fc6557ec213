"""Losses (conf/loss): what a model's output is trained against, and which metrics an evaluation reports.

Every engine uses the same Loss object: eager PyTorch and ORTModule call it inside the module they run (so
ORTModule keeps it in its ONNX graph); the artifacts engine uses ORT's own loss block when `ort_block` gives one
and otherwise exports the loss with the model. Evaluation metrics are computed by `sums` on the model's outputs
for the real (unpadded) samples, identically in every engine.

Built-in: `cross_entropy` (classification, accuracy), `mse` (regression, mean absolute error), `bce_with_logits`
(binary/multi-label, accuracy at logit 0). `loss=custom loss._target_=my_pkg.my_loss` takes any function
`(output, targets) -> scalar tensor` (or a class whose instances are one, e.g. torch.nn.SmoothL1Loss).
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from ortflow.errors import OrtflowError

IGNORE_INDEX = -100  # torch's default ignore_index; padding targets of classification batches carry it


@dataclass
class EvalResult:
    """Sums over eval batches, so that batches of any size aggregate exactly: `loss_sum / count` is the mean loss,
    `sums[k] / count` the mean of metric k."""

    loss_sum: float
    count: int  # what the mean divides by: counted targets (classification) or target elements
    sums: dict[str, float] = field(default_factory=dict)

    def __add__(self, other: "EvalResult") -> "EvalResult":
        keys = self.sums.keys() | other.sums.keys()
        return EvalResult(
            self.loss_sum + other.loss_sum,
            self.count + other.count,
            {k: self.sums.get(k, 0.0) + other.sums.get(k, 0.0) for k in keys},
        )

    def metrics(self) -> dict[str, float]:
        count = max(self.count, 1)
        return {"eval/loss": self.loss_sum / count, **{f"eval/{k}": v / count for k, v in self.sums.items()}}


class Loss:
    """A loss: `loss(output, targets)` is the batch's mean loss (a scalar tensor)."""

    task = "custom"
    metrics: tuple[str, ...] = ()  # eval metrics besides eval/loss

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def sums(self, output: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        """Loss and metric sums over one batch (by default: the mean loss times the samples)."""
        n = targets.size(0)
        return EvalResult(float(self(output, targets)) * n, n)

    def problem(self, output: torch.Tensor, targets: torch.Tensor) -> str | None:
        """What is wrong with a model output for these targets, or None (shapes, dtypes, classes)."""
        return None

    def pad_targets(self, targets: torch.Tensor, missing: int) -> torch.Tensor | None:
        """`missing` target rows that carry no loss (to fill a short batch), or None if this loss has none."""
        return None

    def ort_block(self) -> Any:
        """ORT's onnxblock loss computing the same value on (`flat_output`, `flat_targets`), or None."""
        return None

    def flat_output(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The output in the layout `ort_block` takes (`targets`: a batch's, for their shape)."""
        return output

    def flat_targets(self, targets: torch.Tensor) -> torch.Tensor:
        return targets

    def unflat_output(self, flat: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The inverse of `flat_output`, for a batch with these targets."""
        return flat


class CrossEntropy(Loss):
    """Cross-entropy over logits and int64 class ids in torch's layouts, (B, C) or (B, C, d1, ...) logits with
    (B, d1, ...) targets, or ortflow's (B, ..., C) with (B, ...) targets (sequence models); mean over targets !=
    ignore_index. Where shapes fit both (logits (B, 5, 5), targets (B, 5)), `class_dim` (1 or -1) decides."""

    task = "classification"
    metrics = ("accuracy",)

    def __init__(self, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0, class_dim: int | None = None):
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.class_dim = class_dim
        self._dim: int | None = class_dim  # the logits' class dimension, once the shapes have decided it

    def _layout(self, output: torch.Tensor, targets: torch.Tensor) -> tuple[int | None, str | None]:
        """The class dimension of `output` for these targets (1 or -1, or the configured one), or why none fits."""
        shape, wanted = tuple(output.shape), tuple(targets.shape)

        def fits(dim: int) -> bool:
            if output.dim() != targets.dim() + 1:
                return False
            rest = list(shape)
            del rest[dim]
            return tuple(rest) == wanted

        if self.class_dim is not None:
            if -output.dim() <= self.class_dim < output.dim() and fits(self.class_dim):
                return self.class_dim, None
            return None, (
                f"forward returned logits of shape {shape} for targets of shape {wanted}; with "
                f"loss.class_dim={self.class_dim} the logits must be the targets' shape with the classes inserted at "
                f"dimension {self.class_dim}"
            )
        torch_layout = output.dim() >= 2 and fits(1)
        ortflow_layout = output.dim() >= 1 and fits(-1)
        if torch_layout and ortflow_layout and output.dim() > 2:
            return None, (
                f"forward returned logits of shape {shape} for targets of shape {wanted}: the classes may be at "
                "dimension 1 (torch's layout, (B, C, d1, ...)) or last (ortflow's, (B, ..., C)); set loss.class_dim=1 "
                "or loss.class_dim=-1 to say which"
            )
        if torch_layout or ortflow_layout:
            return (-1 if ortflow_layout else 1), None
        expected = (
            f"{(*wanted, 'C')} (the targets' shape plus the classes) or {(*wanted[:1], 'C', *wanted[1:])} "
            "(torch's layout, classes at dimension 1)"
        )
        return None, f"forward returned logits of shape {shape}; expected float logits of shape {expected}"

    def _classes_last(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self._dim is None:
            dim, problem = self._layout(output, targets)
            if dim is None:
                raise OrtflowError(f"loss=cross_entropy: {problem}.")
            self._dim = dim
        return output if self._dim in (-1, output.dim() - 1) else output.movedim(self._dim, -1)

    def _ce(self, output: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        output = self._classes_last(output, targets)
        flat, flat_targets = output.reshape(-1, output.size(-1)), targets.reshape(-1)
        if not self.label_smoothing:
            return F.cross_entropy(flat, flat_targets, ignore_index=self.ignore_index, reduction=reduction)
        # torch's label-smoothed cross-entropy, (1 - e) * nll + e * mean over classes of -log p, written out:
        # torch.onnx cannot export F.cross_entropy's label_smoothing (the artifacts engine exports this loss).
        keep = flat_targets != self.ignore_index
        log_p = F.log_softmax(flat, dim=-1)
        nll = -log_p.gather(1, flat_targets.masked_fill(~keep, 0).unsqueeze(1)).squeeze(1)
        per_target = (1 - self.label_smoothing) * nll - self.label_smoothing * log_p.mean(dim=-1)
        total = (per_target * keep.to(per_target.dtype)).sum()
        return total if reduction == "sum" else total / keep.sum()

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._ce(output, targets, "mean")

    def sums(self, output: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        keep = targets != self.ignore_index
        correct = ((self._classes_last(output, targets).argmax(-1) == targets) & keep).sum()
        return EvalResult(float(self._ce(output, targets, "sum")), int(keep.sum()), {"accuracy": float(correct)})

    def problem(self, output: torch.Tensor, targets: torch.Tensor) -> str | None:
        if targets.is_floating_point():
            return (
                f"loss=cross_entropy takes int64 class ids as targets, but the data gives {targets.dtype} targets; "
                "for real-valued targets use loss=mse (or loss=bce_with_logits for 0/1 labels)"
            )
        dim, problem = self._layout(output, targets)
        if dim is None:
            return problem
        self._dim = dim
        classes_found = output.size(dim)
        counted = targets[targets != self.ignore_index]
        classes = int(counted.max()) + 1 if counted.numel() else 0
        if classes_found < classes:
            return (
                f"forward returns {classes_found} classes, but the data has class ids up to {classes - 1}; the "
                f"model needs at least {classes} outputs (e.g. model.vocab_size / num_classes)"
            )
        return None

    def pad_targets(self, targets: torch.Tensor, missing: int) -> torch.Tensor:
        return targets.new_full((missing, *targets.shape[1:]), self.ignore_index)

    def ort_block(self) -> Any:
        if self.label_smoothing:
            return None  # ORT's SoftmaxCrossEntropyLoss has no label smoothing: the loss is exported with the model
        from onnxruntime.training import onnxblock

        return onnxblock.loss.CrossEntropyLoss(ignore_index=self.ignore_index)

    def flat_output(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        output = self._classes_last(output, targets)
        return output.reshape(-1, output.size(-1))

    def flat_targets(self, targets: torch.Tensor) -> torch.Tensor:
        return targets.reshape(-1)

    def unflat_output(self, flat: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        output = flat.reshape(*targets.shape, flat.size(-1))
        return output if self._dim in (None, -1, output.dim() - 1) else output.movedim(-1, self._dim)


class _Elementwise(Loss):
    """A loss on float targets of the output's own shape, averaged over every element."""

    name = ""

    def problem(self, output: torch.Tensor, targets: torch.Tensor) -> str | None:
        if not targets.is_floating_point():
            return (
                f"loss={self.name} takes float targets of the output's shape, but the data gives {targets.dtype} "
                "targets; for class ids use loss=cross_entropy"
            )
        if tuple(output.shape) != tuple(targets.shape):
            return (
                f"forward returned an output of shape {tuple(output.shape)}; loss={self.name} expects the targets' "
                f"shape {tuple(targets.shape)} (e.g. model.num_classes=1 for one regression target)"
            )
        return None


class MSE(_Elementwise):
    """Mean squared error; eval also reports the mean absolute error (eval/mae)."""

    task = "regression"
    metrics = ("mae",)
    name = "mse"

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, targets)

    def sums(self, output: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        error = output - targets
        return EvalResult(float(error.square().sum()), targets.numel(), {"mae": float(error.abs().sum())})

    def ort_block(self) -> Any:
        from onnxruntime.training import onnxblock

        return onnxblock.loss.MSELoss()


class BCEWithLogits(_Elementwise):
    """Binary cross-entropy on logits, for 0/1 (or soft) targets of the output's shape; eval also reports the
    accuracy of the logit's sign against targets > 0.5."""

    task = "binary"
    metrics = ("accuracy",)
    name = "bce_with_logits"

    def __init__(self, pos_weight: float | None = None) -> None:
        self.pos_weight = pos_weight

    def _bce(self, output: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        weight = None if self.pos_weight is None else torch.tensor(self.pos_weight, dtype=output.dtype)
        return F.binary_cross_entropy_with_logits(output, targets, pos_weight=weight, reduction=reduction)

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._bce(output, targets, "mean")

    def sums(self, output: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        correct = ((output > 0) == (targets > 0.5)).sum()
        return EvalResult(float(self._bce(output, targets, "sum")), targets.numel(), {"accuracy": float(correct)})

    def ort_block(self) -> Any:
        if self.pos_weight is not None:
            return None  # exported with the model
        from onnxruntime.training import onnxblock

        return onnxblock.loss.BCEWithLogitsLoss()


class Custom(Loss):
    """A user's loss function, `fn(output, targets) -> scalar tensor`; eval reports its mean per sample."""

    def __init__(self, fn: Callable[..., torch.Tensor], target: str) -> None:
        self.fn = fn
        self.target = target

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.fn(output, targets)

    def problem(self, output: torch.Tensor, targets: torch.Tensor) -> str | None:
        try:
            value = self.fn(output, targets)
        except Exception as err:
            return f"loss._target_={self.target} failed on the model's output ({type(err).__name__}: {err})"
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
            return (
                f"loss._target_={self.target} returned {type(value).__name__} "
                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}; a loss returns a float scalar "
                "tensor (the batch's mean loss)"
            )
        return None


def build(node: DictConfig) -> Loss:
    """The Loss the `loss` group names. A `_target_` that is not an ortflow Loss is a user's loss: a function,
    called as fn(output, targets, **the other keys), or a class, instantiated with the other keys."""
    target = node.get("_target_")
    try:
        obj = get_object(target)
    except Exception as err:
        raise OrtflowError(
            f"loss._target_={target} cannot be imported ({err}). It names a loss function or class, e.g. "
            "loss._target_=my_pkg.losses.my_loss (importable from the working directory), or choose a built-in "
            "loss with loss=cross_entropy|mse|bce_with_logits."
        ) from None
    kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
    try:
        if inspect.isclass(obj):
            built = instantiate(node)
            return built if isinstance(built, Loss) else Custom(built, target)
        if callable(obj):
            return Custom(functools.partial(obj, **kwargs) if kwargs else obj, target)
    except Exception as err:
        raise OrtflowError(f"loss._target_={target} could not be built with {kwargs} ({err}).") from None
    raise OrtflowError(f"loss._target_={target} is a {type(obj).__name__}, not a loss function or class.")
