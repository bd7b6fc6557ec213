"""Turning documents into token ids, in chunks a process pool can share out.

A chunk is a list of segments `(UTF-8 bytes, whether a document separator comes before them)`, about `size` bytes
in all; long documents are cut after a newline (preferably one followed by a non-space, so that runs of whitespace
stay whole), else before a space, else at a UTF-8 character boundary. Each chunk encodes on its own, so chunks can
go to worker processes and come back in order; where the corpus is cut into train and val is a chunk boundary.

This module imports neither torch nor the rest of ortflow's data code: spawned workers start in a second.
"""

import itertools
import os
import re
from collections.abc import Iterable, Iterator

import numpy as np

from ortflow.data.tokens.tokenizer import SPLIT_PATTERN

Segment = tuple[bytes, bool]  # (text, a separator comes before it)
Chunk = list[Segment]
_SPACE = frozenset(b" \t\n\r\f\v")
_NEWLINE_PROBES = 4096  # newlines looked at for one followed by a non-space, before taking any newline


def chunk_size(total_bytes: int) -> int:
    """About 2,000 chunks per corpus, between 256 bytes and 1 MB each: fine-grained enough to hold out an exact share
    of a small corpus, coarse enough to keep a worker pool busy on a large one."""
    return int(min(max(total_bytes // 2000, 2**8), 2**20))


def _cut(buf: bytearray, start: int, end: int) -> int:
    """Where to end a segment that starts at `start` and may not pass `end` (buf holds bytes beyond `end`)."""
    low = start + (end - start) // 2
    pos = buf.rfind(b"\n", low, end)
    first = pos
    for _ in range(_NEWLINE_PROBES):
        if pos == -1 or buf[pos + 1] not in _SPACE:
            break
        pos = buf.rfind(b"\n", low, pos)
    if pos != -1 and buf[pos + 1] not in _SPACE:
        return pos + 1
    if first != -1:
        return first + 1
    space = buf.rfind(b" ", low, end)
    if space > start:
        return space  # the space starts the next segment, as it starts the next word
    cut = end
    while cut > start + 1 and (buf[cut] & 0xC0) == 0x80:  # not inside a UTF-8 multi-byte character
        cut -= 1
    return cut


def chunks(documents: Iterable[Iterable[bytes]], size: int) -> Iterator[Chunk]:
    """Chunks of about `size` bytes from the documents, a separator before every document but the first (empty
    documents are skipped)."""
    chunk: Chunk = []
    filled = 0
    started = False
    for document in documents:
        separate = started
        buf = bytearray()
        produced = False
        for block in document:
            buf += block
            start = 0
            while len(buf) - start > size:
                cut = _cut(buf, start, start + size)
                chunk.append((bytes(buf[start:cut]), separate))
                filled += cut - start + separate
                separate, produced, start = False, True, cut
                if filled >= size:
                    yield chunk
                    chunk, filled = [], 0
            del buf[:start]
        if buf:
            chunk.append((bytes(buf), separate))
            filled += len(buf) + separate
            produced = True
        started = started or produced
        if filled >= size:
            yield chunk
            chunk, filled = [], 0
    if chunk:
        yield chunk


def chunk_bytes(chunk: Chunk) -> int:
    """The bytes a chunk stands for: its text plus one per separator (bits per byte count separators as bytes
    with every tokenizer, so byte-level and BPE runs divide by the same number)."""
    return sum(len(text) + separate for text, separate in chunk)


def sample(chunks_: Iterable[Chunk], total_bytes: int, budget: int) -> Iterator[str]:
    """Texts of every k-th chunk, k chosen so that about `budget` bytes of a `total_bytes` corpus are taken,
    evenly spread over it (the BPE trainer's bounded sample); stops once the budget is spent."""
    every = max(1, -(-total_bytes // max(budget, 1)))
    taken = 0
    for chunk in itertools.islice(chunks_, 0, None, every):
        for text, _ in chunk:
            yield text.decode("utf-8", errors="replace")
            taken += len(text)
        if taken >= budget:
            return


class BytesEncoder:
    """Bytes are the ids; separator 0."""

    def __init__(self, separator: int, dtype: str) -> None:
        self.separator = np.array([separator], dtype=np.uint8)
        self.dtype = np.dtype(dtype)

    def __call__(self, chunk: Chunk) -> np.ndarray:
        parts = []
        for text, separate in chunk:
            if separate:
                parts.append(self.separator)
            parts.append(np.frombuffer(text, dtype=np.uint8))
        return np.concatenate(parts).astype(self.dtype)


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    fast = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # _fast skips offsets (tokenizers 0.20+)
    return [e.ids for e in fast(texts, add_special_tokens=False)]


class HFEncoder:
    """Any `tokenizers` tokenizer: whole segments at a time."""

    def __init__(self, tokenizer, separator: int | None, dtype: str) -> None:
        self.tokenizer, self.separator, self.dtype = tokenizer, separator, np.dtype(dtype)

    def __call__(self, chunk: Chunk) -> np.ndarray:
        encoded = _encode_batch(self.tokenizer, [t.decode("utf-8", errors="replace") for t, _ in chunk])
        ids: list[int] = []
        for (_, separate), segment in zip(chunk, encoded, strict=True):
            if separate and self.separator is not None:
                ids.append(self.separator)
            ids.extend(segment)
        return np.array(ids, dtype=self.dtype)


class WordEncoder:
    """ortflow's BPE: split into words with SPLIT_PATTERN (the tokenizer's own first step), encode each distinct
    word once with `tokenizers`, and look the rest up. Gives the same ids as encoding the whole text.

    The words' ids live in one flat array (`flat[starts[w]:starts[w] + lengths[w]]` for word number w), so a chunk
    is assembled with a few numpy gathers instead of a Python loop over its ids."""

    MAX_WORDS = 1_000_000  # the word table is cleared when it grows past this

    def __init__(self, tokenizer, separator: int | None, dtype: str) -> None:
        self.tokenizer, self.dtype = tokenizer, np.dtype(dtype)
        self.pattern = re.compile(SPLIT_PATTERN)
        self.separator = [] if separator is None else [separator]
        self._reset()

    def _reset(self) -> None:
        self.number: dict[str | None, int] = {None: 0}  # None: the separator's entry
        self.flat = np.array(self.separator, dtype=self.dtype)
        self.starts = np.zeros(1, dtype=np.int64)
        self.lengths = np.array([len(self.separator)], dtype=np.int64)

    def _add(self, words: list[str]) -> None:
        encoded = _encode_batch(self.tokenizer, words)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        base = len(self.flat)
        self.starts = np.concatenate([self.starts, base + np.cumsum(lengths) - lengths])
        self.lengths = np.concatenate([self.lengths, lengths])
        self.flat = np.concatenate([self.flat, np.fromiter(itertools.chain.from_iterable(encoded), dtype=self.dtype)])
        first = len(self.number)
        self.number.update(zip(words, range(first, first + len(words)), strict=True))

    def __call__(self, chunk: Chunk) -> np.ndarray:
        words: list[str | None] = []
        for text, separate in chunk:
            if separate:
                words.append(None)
            words.extend(self.pattern.findall(text.decode("utf-8", errors="replace")))
        if len(self.number) > self.MAX_WORDS:
            self._reset()
        missing = [w for w in set(words) if w not in self.number]
        if missing:
            self._add(missing)
        numbers = np.fromiter(map(self.number.__getitem__, words), dtype=np.int64, count=len(words))
        lengths = self.lengths[numbers]
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if len(ends) else 0
        # output position i reads flat[its word's start + i - the output position where its word begins]
        positions = np.repeat(self.starts[numbers] - (ends - lengths), lengths) + np.arange(total)
        return self.flat[positions]


def make_encoder(kind: str, tokenizer_json: str | None, separator: int | None, dtype: str):
    """The encoder for a tokenizer kind ("bytes", "bpe" (ortflow's own), "pretrained")."""
    if kind == "bytes":
        return BytesEncoder(separator if separator is not None else 0, dtype)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True  # text spelling "<|endoftext|>" stays text
    return (WordEncoder if kind == "bpe" else HFEncoder)(tokenizer, separator, dtype)


# ------------------------------------------------------------------------------------------ worker processes
_encoder = None


def init_worker(kind: str, tokenizer_json: str | None, separator: int | None, dtype: str) -> None:
    """Pool initializer: one encoder per worker. Each worker is one process with one thread (the tokenizer's own
    thread pool off), so data.num_proc processes use data.num_proc cores."""
    global _encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _encoder = make_encoder(kind, tokenizer_json, separator, dtype)


def encode_in_worker(chunk: Chunk) -> np.ndarray:
    return _encoder(chunk)
