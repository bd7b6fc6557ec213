"""Byte-level language-modelling data from the embedded corpus or any local text file.

Bytes are the tokens (vocabulary 256), so any file in any encoding works with no tokenizer to train or ship.
The embedded corpus is CPython's own documentation text (`pydoc_data.topics`, ~466 KB of English), present
in every Python installation: no download, identical on every machine.
"""

import logging
import math
import stat
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from ortflow.data import Data
from ortflow.errors import OrtflowError

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
EMBEDDED = "python_docs"


def _embedded_corpus() -> bytes:
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


def _read_file(path: str, max_bytes: int) -> bytes:
    """The file's bytes, after checking (without opening it) that it is a regular, readable, non-empty file of at
    most `max_bytes`: a FIFO or a device would block or never end."""
    file = Path(path).expanduser()
    try:
        info = file.stat()
    except FileNotFoundError:
        raise OrtflowError(
            f"data.source: text file '{file}' does not exist. Give an existing file, e.g. "
            f"data.source=/abs/path/corpus.txt, or data.source={EMBEDDED} for the embedded corpus."
        ) from None
    except OSError as err:
        raise OrtflowError(f"data.source: cannot read text file '{file}': {err.strerror}.") from None
    if stat.S_ISDIR(info.st_mode):
        raise OrtflowError(f"data.source: '{file}' is a directory; give one text file.")
    if not stat.S_ISREG(info.st_mode):
        raise OrtflowError(
            f"data.source: '{file}' is not a regular file (a pipe, socket or device would block or never end); "
            "give a text file on disk."
        )
    if info.st_size == 0:
        raise OrtflowError(f"data.source: text file '{file}' is empty.")
    if info.st_size > max_bytes:
        raise OrtflowError(
            f"data.source: text file '{file}' has {info.st_size:,} bytes, more than data.max_bytes={max_bytes:,} "
            "(each byte becomes an 8-byte token in memory). Raise data.max_bytes if the machine has the memory, or "
            "use a smaller file."
        )
    try:
        return file.read_bytes()
    except OSError as err:
        raise OrtflowError(f"data.source: cannot read text file '{file}': {err.strerror}.") from None


class Windows(Dataset):
    """Non-overlapping windows of block_size + 1 bytes: input = window[:-1], target = window[1:]."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def unigram_entropy(data: bytes) -> float:
    """Entropy in nats of the byte distribution: the loss of the best model that ignores context."""
    counts = Counter(data)
    n = len(data)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def build_text_data(
    source: str,
    block_size: int,
    batch_size: int,
    val_fraction: float,
    seed: int,
    num_workers: int = 0,
    max_bytes: int = 256 * 2**20,
    batch_first: bool = True,
) -> Data:
    """Split a byte stream into train (first part) and validation (last part) windows.

    Args:
        source: `python_docs` for the embedded corpus, or a path to a local text file.
        block_size: tokens per training sequence.
        batch_size: sequences per batch.
        val_fraction: share of the bytes held out for evaluation, taken from the end.
        seed: seeds the training shuffle (same seed, same batch order).
        num_workers: DataLoader worker processes.
        max_bytes: the largest file read (a regular file only; FIFOs and devices are refused before opening).
        batch_first: False for a sequence-first model (it gets (T, B) token ids; its outputs are transposed back).

    Raises:
        OrtflowError: the file is missing or unreadable, or too small for one train and one val window.
    """
    if not source.strip():
        raise OrtflowError(f"data.source is empty; give a text file path or data.source={EMBEDDED}.")
    raw = _embedded_corpus() if source == EMBEDDED else _read_file(source, max_bytes)
    n_val = int(len(raw) * val_fraction)
    train_bytes, val_bytes = raw[: len(raw) - n_val], raw[len(raw) - n_val :]
    need = block_size + 1
    if len(train_bytes) < need * batch_size or len(val_bytes) < need:
        raise OrtflowError(
            f"data.source: '{source}' has {len(raw)} bytes, too few for one training batch of "
            f"data.batch_size={batch_size} x (data.block_size={block_size} + 1) bytes plus one validation "
            f"window ({val_fraction:.0%} held out). Use a larger file or lower data.block_size/data.batch_size."
        )
    to_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).long()  # noqa: E731
    train_set, val_set = Windows(to_tensor(train_bytes), block_size), Windows(to_tensor(val_bytes), block_size)
    generator = torch.Generator().manual_seed(seed)
    train = DataLoader(
        train_set, batch_size, shuffle=True, drop_last=True, generator=generator, num_workers=num_workers
    )
    val = DataLoader(val_set, batch_size, shuffle=False, num_workers=num_workers)
    entropy = unigram_entropy(train_bytes)
    log.info(
        "text data '%s': %d train / %d val windows of %d bytes; unigram entropy %.3f nats",
        source,
        len(train_set),
        len(val_set),
        block_size,
        entropy,
    )
    return Data(
        train,
        val,
        batch_first=batch_first,
        info={
            "source": source,
            "train_windows": len(train_set),
            "val_windows": len(val_set),
            "unigram_entropy": entropy,
            "vocab_size": VOCAB_SIZE,
        },
    )
