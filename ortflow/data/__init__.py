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
        batch_first: whether the model takes the batches as they come, (B, T, ...); False: the model is
            sequence-first and ortflow hands it (T, B, ...) inputs and transposes its outputs back.
    """

    train: DataLoader
    val: DataLoader
    info: dict[str, float | int | str] = field(default_factory=dict)
    batch_first: bool = True
