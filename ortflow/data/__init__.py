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
        fingerprint: identifies the data's content (a short hex digest, cheap to recompute on large sources), or
            None when the builder cannot tell. It is recorded in run.json and checkpoints; a run resumed on data
            with another fingerprint is refused unless trainer.allow_data_change=true.
        tokenizer: identifies the tokenizer the token ids come from (text data), or None. A checkpoint written with
            another tokenizer is always refused: its embeddings mean other tokens.
    """

    train: DataLoader
    val: DataLoader
    info: dict[str, float | int | str] = field(default_factory=dict)
    batch_first: bool = True
    fingerprint: str | None = None
    tokenizer: str | None = None
