"""Data builders: plain functions returning a `Data` (train/val DataLoaders plus facts about the data)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is not imported here: token-encoding worker processes import ortflow.data.tokens.encode only
    import torch
    from torch.utils.data import DataLoader


@dataclass
class Data:
    """What a data builder returns.

    Attributes:
        train: yields (inputs, targets) batches; full batches only, reshuffled each epoch. A stateful source
            (with state_dict/load_state_dict, e.g. ortflow.data.tokens.blocks.RandomBlocks) keeps its own position,
            which checkpoints save; one with `shard(rank, world_size)` shards itself across DDP ranks.
        val: yields (inputs, targets) batches in a fixed order; the last batch may be smaller.
        info: facts worth logging (sizes, the unigram entropy a language model must beat, ...).
        batch_first: whether the model takes the batches as they come, (B, T, ...); False: the model is
            sequence-first and ortflow hands it (T, B, ...) inputs and transposes its outputs back.
        fingerprint: identifies the data's content (a short hex digest, cheap to recompute on large sources), or
            None when the builder cannot tell. It is recorded in run.json and checkpoints; a run resumed on data
            with another fingerprint is refused unless trainer.allow_data_change=true.
        tokenizer: identifies the tokenizer the token ids come from (text data), or None. A checkpoint written with
            another tokenizer is always refused: its embeddings mean other tokens.
        tokenizer_object: that tokenizer, with encode(text) -> ids and decode(ids) -> text (text data), or None.
        eval_metrics: derives more eval metrics from an evaluation's (e.g. eval/bits_per_byte from eval/loss), or
            None.
        run_files: files the run dir keeps a copy of, name -> content (text data: its tokenizer and manifest, so
            that ortflow-predict finds the run's tokenizer from the run dir).
    """

    train: "DataLoader"
    val: "DataLoader"
    info: dict[str, float | int | str] = field(default_factory=dict)
    batch_first: bool = True
    fingerprint: str | None = None
    tokenizer: str | None = None
    tokenizer_object: Any = None
    eval_metrics: Callable[[dict[str, float]], dict[str, float]] | None = None
    run_files: dict[str, bytes] = field(default_factory=dict)


def tensors_fingerprint(*tensors: "torch.Tensor") -> str:
    """A content digest (16 hex digits) of in-memory tensors: small bundled data sets' fingerprint."""
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
