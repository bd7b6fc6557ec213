"""Endless training batches with a position that a checkpoint can save and restore exactly."""

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import RandomSampler


class ResumableBatches:
    """Batches from `loader`, epoch after epoch, remembering (epoch, batches taken in it, the loader's generator
    state when the epoch began).

    Restoring that position resets the generator to the epoch's start, so the epoch reshuffles into the same order,
    and skips the batches already taken: the next batch is the one an uninterrupted run would get. Without a
    generator on the loader (a DataLoader built with no `generator=`) the order after a resume is not reproduced.

    A stateful source (one with `state_dict`/`load_state_dict`, e.g. ortflow.data.tokens.blocks.RandomBlocks) keeps its
    own position: its batches are passed through and its state is what a checkpoint saves.
    """

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.stateful = hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
        self.epoch = 0
        self.index = 0  # batches taken in the current epoch
        self._generator: torch.Generator | None = getattr(loader, "generator", None)
        self._epoch_start = self._generator.get_state() if self._generator is not None else None
        self._iterator: Iterator | None = None

    @property
    def exact(self) -> bool:
        """Whether a restored position reproduces the uninterrupted order."""
        sampler = getattr(self.loader, "sampler", None)
        return self.stateful or self._generator is not None or not isinstance(sampler, RandomSampler)

    def __iter__(self) -> "ResumableBatches":
        return self

    def __next__(self) -> Any:
        if self.stateful:
            if self._iterator is None:
                self._iterator = iter(self.loader)
            return next(self._iterator)
        if self._iterator is None:
            if self._generator is not None:
                self._epoch_start = self._generator.get_state()
            if hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
                self.loader.sampler.set_epoch(self.epoch)  # DistributedSampler: each epoch's order from (seed, epoch)
            self._iterator = iter(self.loader)
            for _ in range(self.index):  # after a restore: the batches this epoch already gave
                next(self._iterator, None)
        try:
            batch = next(self._iterator)
        except StopIteration:
            if self.index == 0:
                raise ValueError("the training data yields no batches") from None
            self.epoch, self.index, self._iterator = self.epoch + 1, 0, None
            return next(self)
        self.index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        if self.stateful:
            return {"source": self.loader.state_dict()}
        return {"epoch": self.epoch, "index": self.index, "generator": self._epoch_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.stateful:
            self.loader.load_state_dict(state.get("source"))
            self._iterator = None
            return
        self.epoch, self.index, self._iterator = state["epoch"], state["index"], None
        if self._generator is not None and state["generator"] is not None:
            self._generator.set_state(state["generator"])
