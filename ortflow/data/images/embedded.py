"""`data=images`: the embedded shapes (shapes.py), drawn from the seed at build time; no download, no files."""

import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ortflow.data import Data
from ortflow.data.images import shapes
from ortflow.data.images.splits import split_loaders
from ortflow.data.images.transforms import Transforms
from ortflow.errors import DataError

log = logging.getLogger(__name__)


def build_images_data(
    image_size: int,
    train_images: int,
    val_images: int,
    noise: float,
    batch_size: int,
    seed: int,
    crop: Any,
    crop_scale: Sequence[float],
    hflip: float,
    mean: Sequence[float],
    std: Sequence[float],
    resize: int | None = None,
    num_workers: int = 0,
) -> Data:
    """Draw the training and validation images (separate streams of one seed) and wrap them in loaders.

    Batches are ((B, 3, image_size, image_size) float images, normalised; (B,) int64 class ids in 0..9).

    Args:
        image_size: side of the drawn images in pixels (and of what the model gets).
        train_images: images drawn for training (classes balanced).
        val_images: images drawn for evaluation.
        noise: standard deviation of the Gaussian pixel noise (intensities in [0, 1]).
        batch_size: images per batch.
        seed: seeds the drawing, the training order and the augmentation.
        crop, crop_scale, hflip, mean, std, resize: the transforms (transforms.py).
        num_workers: DataLoader worker processes.

    Raises:
        DataError: torchvision (for the transforms) is not installed, a transform setting is invalid, or there are
            fewer training images than one batch.
    """
    if train_images < batch_size:
        raise DataError(
            f"data.train_images={train_images} is fewer than one batch of data.batch_size={batch_size}; raise "
            "data.train_images or lower data.batch_size."
        )
    transforms = Transforms.from_config(image_size, resize, crop, crop_scale, hflip, mean, std)
    train_transform, val_transform = transforms.train(image_size), transforms.eval(image_size)
    (x_train, y_train), (x_val, y_val) = _draw(train_images, val_images, image_size, noise, seed)
    train, val = split_loaders(
        (x_train.__getitem__, y_train),
        (x_val.__getitem__, y_val),
        (train_transform, val_transform),
        batch_size,
        seed,
        num_workers,
    )
    fingerprint = _fingerprint(image_size, train_images, val_images, noise, seed)
    _log_drawn(train_images, val_images, image_size)
    info = _info(train_images, val_images, transforms, fingerprint)
    return Data(train, val, info, fingerprint=fingerprint)


def _draw(
    train_images: int, val_images: int, image_size: int, noise: float, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Draw the training and validation shapes from separate streams of `seed`, as (images, class ids) tensors."""
    streams = np.random.SeedSequence(seed).spawn(2)  # training and validation images never share draws
    x_train, y_train = shapes.generate(train_images, image_size, noise, np.random.default_rng(streams[0]))
    x_val, y_val = shapes.generate(val_images, image_size, noise, np.random.default_rng(streams[1]))
    x_train, x_val = torch.from_numpy(x_train), torch.from_numpy(x_val)  # uint8 (N, 3, S, S)
    return (x_train, torch.from_numpy(y_train)), (x_val, torch.from_numpy(y_val))


def _fingerprint(image_size: int, train_images: int, val_images: int, noise: float, seed: int) -> str:
    """A digest of the settings that decide the drawn images (the generator's version included)."""
    settings = {
        "generator": shapes.GENERATOR,
        "image_size": image_size,
        "train_images": train_images,
        "val_images": val_images,
        "noise": noise,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _log_drawn(train_images: int, val_images: int, image_size: int) -> None:
    """Log how many shapes were drawn, their size and the number of classes."""
    log.info(
        "images: %d train / %d val drawn shapes of %dx%d pixels, %d classes",
        train_images,
        val_images,
        image_size,
        image_size,
        len(shapes.CLASSES),
    )


def _info(train_images: int, val_images: int, transforms: Transforms, fingerprint: str) -> dict[str, Any]:
    """The data's description for the run's records: the source, the image and class counts, the transforms."""
    return {
        "source": f"embedded shapes ({shapes.GENERATOR})",
        "train_images": train_images,
        "val_images": val_images,
        "classes": len(shapes.CLASSES),
        "class_names": ", ".join(shapes.CLASSES),
        **transforms.info(),
        "fingerprint": fingerprint,
    }
