"""Loaders for image data whose training augmentation is reproducible in every accel mode and after a resume.

torchvision's random transforms draw from torch's global generator, which the engines consume differently (and a
resumed run restores only at step boundaries). Here the training sampler draws, from the loader's own seeded
generator, both the order of the images and one seed per image for its augmentation; the dataset applies the
transforms under that seed. ResumableBatches restores the generator at an epoch's start, so a resumed run gets the
same images with the same crops and flips, and so does every accel mode.
"""

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class AugmentSeeds(Sampler[tuple[int, int]]):
    """A random order of `size` indices, each paired with a seed for that draw's augmentation, both from
    `generator` (the training loader's)."""

    def __init__(self, size: int, generator: torch.Generator) -> None:
        self.size = size
        self.generator = generator

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = torch.randperm(self.size, generator=self.generator)
        seeds = torch.randint(0, 2**62, (self.size,), generator=self.generator)
        return iter(zip(order.tolist(), seeds.tolist(), strict=True))

    def __len__(self) -> int:
        return self.size


class Transformed(Dataset):
    """`(transform(load(i)), labels[i])`. Indexed by `(i, seed)` (AugmentSeeds) the transform runs under that seed;
    indexed by a plain `i` (an evaluation loader, DistributedSampler, an example batch) it draws from torch's
    generator, as torchvision's datasets do."""

    def __init__(self, load: Callable[[int], Any], labels: torch.Tensor, transform: Callable[[Any], Any]) -> None:
        self.load = load
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(key, tuple):
            index, seed = key
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                image = self.transform(self.load(index))
        else:
            index = key
            image = self.transform(self.load(index))
        return image, self.labels[index]


def image_loaders(
    train: Transformed, val: Dataset, batch_size: int, seed: int, num_workers: int
) -> tuple[DataLoader, DataLoader]:
    """The training loader (full batches only, order and augmentation from a generator seeded with `seed`) and the
    evaluation loader (fixed order; its last batch may be smaller)."""
    generator = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(
        train,
        batch_size,
        sampler=AugmentSeeds(len(train), generator),
        drop_last=True,
        generator=generator,  # ResumableBatches saves and restores this generator's state
        num_workers=num_workers,
    )
    val_loader = DataLoader(val, batch_size, shuffle=False, num_workers=num_workers)
    return train_loader, val_loader
