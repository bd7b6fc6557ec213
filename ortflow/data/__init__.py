"""Data builders: plain functions returning a `Data` (train/val DataLoaders plus facts about the data)."""

from dataclasses import dataclass, field

from torch.utils.data import DataLoader


@dataclass
class Data:
    """What a data builder returns.

    Attributes:
        train: yields (inputs, targets) batches; full batches only, reshuffled each epoch.
        val: yields (inputs, targets) batches in a fixed order; the last batch may be smaller.
        info: facts worth logging (sizes, the unigram entropy a language model must beat, ...).
    """

    train: DataLoader
    val: DataLoader
    info: dict[str, float | int | str] = field(default_factory=dict)
