"""`model=torchvision`: any torchvision.models builder by name (`model.name=resnet18`), or one of its model classes
(`model.name=VisionTransformer`), with keyword arguments from config. Weights are random unless model.weights names
some (which torchvision then downloads): a run never reaches the network by default."""

import difflib
import logging
from typing import Any

from torch import nn

from ortflow.errors import ModelError

log = logging.getLogger(__name__)


def _torchvision_models() -> Any:
    try:
        import torchvision.models
    except ImportError:
        raise ModelError(
            "model=torchvision needs torchvision, which is not installed. Install ortflow's vision extra, "
            "pip install 'ortflow[vision]' (it installs the torchvision release matching your torch)."
        ) from None
    return torchvision.models


def build_torchvision(
    name: str, num_classes: int, weights: str | None = None, kwargs: dict[str, Any] | None = None
) -> nn.Module:
    """Build `torchvision.models.get_model(name, weights=weights, num_classes=num_classes, **kwargs)`, or, when
    `name` is one of torchvision.models' classes (VisionTransformer, ResNet, ...), that class with
    `num_classes` and `kwargs` (a class takes every architecture argument, so small variants can be built).

    Args:
        name: a builder listed by torchvision.models.list_models() (resnet18, vit_b_16, ...) or a class name.
        num_classes: output logits.
        weights: a weights name for the builder (e.g. DEFAULT: downloaded by torchvision), or None for random init.
        kwargs: the builder's or class's other keyword arguments (e.g. {image_size: 32} for vit_b_16).

    Returns:
        The model, mapping (B, 3, H, W) float images to (B, num_classes) logits.

    Raises:
        ModelError: torchvision is missing, the name is unknown, or the builder refuses the arguments.
    """
    models = _torchvision_models()
    extra = dict(kwargs or {})
    builders = models.list_models()
    target = getattr(models, name, None)
    is_class = isinstance(target, type) and issubclass(target, nn.Module)
    if name not in builders and not is_class:
        close = difflib.get_close_matches(name, builders, n=3)
        raise ModelError(
            f"model.name={name} is not a torchvision.models builder or model class"
            f"{f'; did you mean {close}?' if close else ''} (torchvision.models.list_models() lists the builders)."
        )
    if is_class and weights is not None:
        raise ModelError(
            f"model.weights={weights}: weights belong to builders (resnet18, ...), not to the class {name}."
        )
    try:
        if is_class:
            model = target(num_classes=num_classes, **extra)
        else:
            model = models.get_model(name, weights=weights, num_classes=num_classes, **extra)
    except (TypeError, ValueError) as err:  # an argument the builder does not take, or a value it refuses
        raise ModelError(
            f"model=torchvision model.name={name}: the builder refused its arguments (num_classes={num_classes}, "
            f"weights={weights}, kwargs={extra}): {err}. Builders such as vit_b_16 fix their architecture; build the "
            "class (model.name=VisionTransformer) to choose every size."
        ) from None
    params = sum(p.numel() for p in model.parameters())
    log.info("built torchvision %s (%d classes, weights %s): %d parameters", name, num_classes, weights, params)
    return model
