"""Language-model data: any text source, any tokenizer, streamed from a prepared token file.

`data.source` is raw text (the embedded corpus, a file, a folder, JSON lines, parquet, a saved Hugging Face
dataset) or a folder `ortflow-prepare` wrote. Raw text is prepared once into the token cache
(ortflow/data/tokens/prepare.py) and reused; the embedded corpus with the byte tokenizer (the default) is tokenized in
memory instead, so the default run writes nothing outside its run dir. Training draws random blocks from the train
split through np.memmap (ortflow/data/tokens/blocks.py: memory independent of the corpus' size, the position saved in
checkpoints); evaluation reads a fixed set of windows of the validation split.
"""

import functools
import logging
import math
from collections import Counter

from torch.utils.data import DataLoader

from ortflow.data import Data
from ortflow.data.tokens.blocks import RandomBlocks, Windows
from ortflow.data.tokens.prepare import PrepareSettings, open_or_prepare
from ortflow.data.tokens.sources import EMBEDDED
from ortflow.data.tokens.store import TokenStore
from ortflow.data.tokens.tokenizer import BYTES
from ortflow.errors import DataError

log = logging.getLogger(__name__)

VOCAB_SIZE = 256  # the byte tokenizer's
__all__ = ["EMBEDDED", "VOCAB_SIZE", "bits_per_byte", "build_text_data", "unigram_entropy"]


def unigram_entropy(data: bytes) -> float:
    """Entropy in nats of the byte distribution: the loss of the best model that ignores context."""
    counts = Counter(data)
    n = len(data)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def bits_per_byte(metrics: dict[str, float], tokens_per_byte: float) -> dict[str, float]:
    """eval/bits_per_byte = eval/loss (nats per token) x tokens per byte of the validation split / ln 2: a loss that
    byte-level and BPE runs on the same text share."""
    if "eval/loss" not in metrics:
        return {}
    return {"eval/bits_per_byte": metrics["eval/loss"] * tokens_per_byte / math.log(2)}


def build_text_data(
    source: str,
    block_size: int,
    batch_size: int,
    val_fraction: float,
    seed: int,
    num_workers: int = 0,
    batch_first: bool = True,
    tokenizer: str = BYTES,
    bpe_vocab_size: int = 8192,
    bpe_train_bytes: int = 100_000_000,
    text_field: str = "text",
    cache_dir: str | None = None,
    num_proc: int | None = None,
    vocab_size: int | None = None,
    max_bytes: int | None = None,
) -> Data:
    """Language-model data from a text source, tokenized by `tokenizer`.

    Args:
        source: `python_docs` (the embedded corpus), a text file, a folder, a .jsonl or .parquet file, a saved
            Hugging Face dataset, or a folder ortflow-prepare wrote.
        block_size: tokens per training sequence.
        batch_size: sequences per batch (per rank).
        val_fraction: share of the corpus' bytes held out for evaluation, taken from the end.
        seed: seeds the training blocks (same seed and position, same batch).
        num_workers: DataLoader worker processes for the validation windows.
        batch_first: False for a sequence-first model (it gets (T, B) token ids; its outputs are transposed back).
        tokenizer: `bytes`, `bpe`, or a tokenizer.json path / local Hugging Face cache name.
        bpe_vocab_size: the BPE tokenizer's vocabulary (tokenizer=bpe).
        bpe_train_bytes: at most this much text (an evenly spread sample) trains the BPE tokenizer.
        text_field: the record field holding the text (JSON lines, parquet, datasets).
        cache_dir: the token cache (null: ~/.cache/ortflow/tokens).
        num_proc: processes that encode the corpus (null: the CPUs available).
        vocab_size: leave null: the runner fills it from the tokenizer (the model's vocabulary follows it).
        max_bytes: ignored (the limit of the former in-memory loader; accepted so that older run dirs load).

    Raises:
        DataError: a bad source or tokenizer (named), a corrupt prepared store, too little text for one batch and one
            validation window, or data.vocab_size set to another vocabulary than the tokenizer's.
    """
    del max_bytes
    settings = PrepareSettings(
        source, tokenizer, bpe_vocab_size, bpe_train_bytes, val_fraction, text_field, cache_dir, num_proc
    )
    store = open_or_prepare(settings)
    _check_vocab_size(store, vocab_size)
    _check_val_tokens(store, source, block_size, val_fraction)
    train = RandomBlocks(store.train, block_size, batch_size, seed)
    val_set = Windows(store.val, block_size)
    val = DataLoader(val_set, batch_size, shuffle=False, num_workers=num_workers)
    info = _info(source, store, block_size, len(val_set))
    log.info("text data: %s", ", ".join(f"{k} {v}" for k, v in info.items()))
    return _text_data(store, train, val, info, batch_first)


def _check_vocab_size(store: TokenStore, vocab_size: int | None) -> None:
    """Refuse a data.vocab_size that is set and differs from the tokenizer's vocabulary.

    Raises:
        DataError: data.vocab_size is not the tokenizer's vocabulary.
    """
    vocab = store.tokenizer.vocab_size
    if vocab_size is not None and vocab_size != vocab:
        raise DataError(
            f"data.vocab_size={vocab_size}, but the tokenizer ({store.tokenizer.kind}) has {vocab} tokens; leave "
            "data.vocab_size null: it is filled from the tokenizer."
        )


def _check_val_tokens(store: TokenStore, source: str, block_size: int, val_fraction: float) -> None:
    """Refuse a validation split too short for one window of block_size + 1 tokens.

    Raises:
        DataError: the validation split holds fewer than block_size + 1 tokens.
    """
    if len(store.val) < block_size + 1:
        raise DataError(
            f"data.source: '{source}' gives {len(store.val):,} validation tokens, too few for one window of "
            f"data.block_size={block_size} + 1 ({val_fraction:.0%} held out). Use a larger corpus, or lower "
            "data.block_size."
        )


def _text_data(
    store: TokenStore, train: RandomBlocks, val: DataLoader, info: dict[str, float | int | str], batch_first: bool
) -> Data:
    """The Data a run gets: the loaders, the info, and the store's fingerprint, tokenizer, bits-per-byte metric and
    run files."""
    return Data(
        train,
        val,
        info=info,
        batch_first=batch_first,
        fingerprint=store.manifest["fingerprint"],
        tokenizer=store.tokenizer.identity,
        tokenizer_object=store.tokenizer,
        eval_metrics=functools.partial(bits_per_byte, tokens_per_byte=store.tokens_per_byte),
        run_files=store.run_files(),
    )


def _info(source: str, store: TokenStore, block_size: int, val_windows: int) -> dict[str, float | int | str]:
    manifest = store.manifest
    entropy = manifest["unigram_entropy"]
    return {
        "source": source,
        "prepared": str(store.path) if store.path else "in memory",
        "tokenizer": store.tokenizer.kind,
        "tokenizer_identity": store.tokenizer.identity,
        "vocab_size": store.tokenizer.vocab_size,
        "train_tokens": len(store.train),
        "val_tokens": len(store.val),
        "val_windows": val_windows,
        "block_size": block_size,
        "tokens_per_byte": store.tokens_per_byte,
        "unigram_entropy": entropy,  # nats per token
        "unigram_bits_per_byte": entropy * store.tokens_per_byte / math.log(2),
        "fingerprint": manifest["fingerprint"],
    }
