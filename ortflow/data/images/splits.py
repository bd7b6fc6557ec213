"""The loaders of an image data set's two splits, shared by data=images (embedded.py) and data=image_folder
(folder.py): each split's images and class ids, under the training or the evaluation transform."""

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from ortflow.data.images.loaders import Transformed, image_loaders

Images = tuple[Callable[[int], Any], torch.Tensor]  # a split: loads image i, and the class ids
Transform = Callable[[Any], torch.Tensor]


def split_loaders(
    train: Images,
    val: Images,
    transforms: tuple[Transform, Transform],
    batch_size: int,
    seed: int,
    num_workers: int,
) -> tuple[DataLoader, DataLoader]:
    """The training and validation loaders: each split's images wrapped with its transform (the training one,
    then the evaluation one) and batched by `image_loaders`."""
    (load_train, train_labels), (load_val, val_labels) = train, val
    train_transform, val_transform = transforms
    train_set = Transformed(load_train, train_labels, train_transform)
    val_set = Transformed(load_val, val_labels, val_transform)
    return image_loaders(train_set, val_set, batch_size, seed, num_workers)
