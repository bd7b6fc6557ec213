"""Image transforms from config, in the vocabulary of torchvision's classification references and timm.

Training: `crop=random_resized` (RandomResizedCrop to image_size, area share in crop_scale) or `crop=center` (the
evaluation crop, no random crop), then a horizontal flip with probability `hflip`. Evaluation: the shorter side
resized to `resize` (null: image_size), a center crop of image_size. Both end with scaling to [0, 1] and
Normalize(mean, std). torchvision is an optional extra (`pip install 'ortflow[vision]'`).
"""

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

import torch

from ortflow.errors import ConfigError, DataError


def require_torchvision(what: str, module: str = "torchvision") -> ModuleType:
    """`module` (torchvision or one of its modules), or a DataError saying how to install torchvision.

    Raises:
        DataError: torchvision is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(
            f"{what} needs torchvision, which is not installed. Install ortflow's vision extra, "
            "pip install 'ortflow[vision]' (it installs the torchvision release matching your torch)."
        ) from None


@dataclass(frozen=True)
class Transforms:
    """The transform settings shared by data=images and data=image_folder (the data.* keys of the same names)."""

    image_size: int  # side of the square images the model gets
    resize: int | None  # evaluation: the shorter side before the center crop; None: image_size
    crop: str  # training crop: random_resized | center
    crop_scale: tuple[float, float]  # random_resized: the share of the image's area a crop covers
    hflip: float  # training: probability of a horizontal flip
    mean: tuple[float, ...]  # per-channel normalisation
    std: tuple[float, ...]

    @classmethod
    def from_config(
        cls,
        image_size: int,
        resize: int | None,
        crop: Any,
        crop_scale: Sequence[float],
        hflip: float,
        mean: Sequence[float],
        std: Sequence[float],
    ) -> "Transforms":
        """Settings from the data config's keys (crop may be the schema's enum).

        Raises:
            DataError: crop is not a known mode, or mean and std differ in length.
            ConfigError: crop_scale is not [min, max].
        """
        crop = crop.value if isinstance(crop, Enum) else str(crop)
        if crop not in ("random_resized", "center"):
            raise DataError(f"data.crop={crop}: choose random_resized or center.")
        if len(mean) != len(std):
            raise DataError(f"data.mean has {len(mean)} values and data.std {len(std)}: give one of each per channel.")
        low, high = (float(s) for s in crop_scale)
        if low > high:
            raise ConfigError(f"data.crop_scale={[low, high]}: give [min, max] shares of the image's area.")
        return cls(image_size, resize, crop, (low, high), float(hflip), tuple(map(float, mean)), tuple(map(float, std)))

    def _evaluation_crop(self, v2: ModuleType, source_size: int | None) -> list[Any]:
        size = self.resize or self.image_size
        resize = [] if source_size == size else [v2.Resize(size, antialias=True)]  # the embedded set is drawn at size
        return [*resize, v2.CenterCrop(self.image_size)]

    def _to_float(self, v2: ModuleType) -> list[Any]:
        return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(self.mean, self.std)]

    def train(self, source_size: int | None = None) -> Callable[[Any], torch.Tensor]:
        """The training pipeline; `source_size`: the side of square source images when all share it (skips a
        resize to the same size).

        Raises:
            DataError: torchvision is not installed.
        """
        v2 = require_torchvision("the image transforms", "torchvision.transforms.v2")
        if self.crop == "random_resized":
            steps = [v2.RandomResizedCrop(self.image_size, scale=self.crop_scale, antialias=True)]
        else:
            steps = self._evaluation_crop(v2, source_size)
        if self.hflip > 0:
            steps.append(v2.RandomHorizontalFlip(self.hflip))
        return v2.Compose([*steps, *self._to_float(v2)])

    def eval(self, source_size: int | None = None) -> Callable[[Any], torch.Tensor]:
        """The evaluation pipeline (deterministic).

        Raises:
            DataError: torchvision is not installed.
        """
        v2 = require_torchvision("the image transforms", "torchvision.transforms.v2")
        return v2.Compose([*self._evaluation_crop(v2, source_size), *self._to_float(v2)])

    def info(self) -> dict[str, Any]:
        return {"image_size": self.image_size, "crop": self.crop, "hflip": self.hflip}
