"""Turning documents into token ids, in chunks a process pool can share out.

A chunk is a list of segments `(UTF-8 bytes, whether a document separator comes before them)`, about `size` bytes
in all; long documents are cut after a newline (preferably one followed by a non-space, so that runs of whitespace
stay whole), else before a space, else at a UTF-8 character boundary. Each chunk encodes on its own, so chunks can
go to worker processes and come back in order; where the corpus is cut into train and val is a chunk boundary.

This module imports neither torch nor the rest of ortflow's data code: spawned workers start in a second.
"""

import itertools
import os
from collections.abc import Iterable, Iterator

import numpy as np

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


# Byte classes of SPLIT_PATTERN (tokenizer.py; tests/data/test_lm_data.py checks that both split alike): letters,
# digits, whitespace, everything else (non-ASCII bytes included).
_LETTER, _DIGIT, _SPACE_CLASS, _OTHER = 0, 1, 2, 3
_CLASSES = np.full(256, _OTHER, dtype=np.uint8)
_CLASSES[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz", dtype=np.uint8)] = _LETTER
_CLASSES[np.frombuffer(b"0123456789", dtype=np.uint8)] = _DIGIT
_CLASSES[np.frombuffer(b" \t\n\r\f", dtype=np.uint8)] = _SPACE_CLASS
_SHORT = 7  # words of up to 7 bytes are keyed by their bytes packed into an integer with their length
_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(_SHORT + 1)], dtype=np.uint64)


def split_words(buf: np.ndarray, segment_starts: np.ndarray) -> np.ndarray:
    """Where SPLIT_PATTERN's words start in `buf` (uint8), each segment split on its own: the same words as
    `re.findall` on each segment. Runs of one byte class, digit runs cut every 3 digits, and a lone space (a
    whitespace run that is one " ") joined to the run after it, as the pattern's leading " ?" does."""
    n = len(buf)
    classes = _CLASSES[buf]
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.not_equal(classes[1:], classes[:-1], out=starts[1:])
    starts[segment_starts] = True
    digits = classes == _DIGIT
    if digits.any():
        run_starts = np.flatnonzero(starts)
        offset = np.arange(n) - run_starts[np.cumsum(starts) - 1]
        starts |= digits & (offset % 3 == 0)
    # a lone space: starts a run, the next byte starts another that is not whitespace, in the same segment
    lone = starts[:-1] & (buf[:-1] == 32) & (classes[1:] != _SPACE_CLASS)
    lone[segment_starts[1:] - 1] = False
    starts[1:][lone] = False
    return np.flatnonzero(starts)


def _distinct(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the rows of the columns: an index of one row per distinct row, and each row's number among those (what
    np.unique's return_index and return_inverse give, without its stable sort)."""
    order = np.argsort(columns[0]) if len(columns) == 1 else np.lexsort(columns[::-1])
    changes = np.zeros(len(order), dtype=bool)
    changes[:1] = True
    for column in columns:
        changes[1:] |= np.diff(column[order]) != 0
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order] = np.cumsum(changes) - 1
    return order[changes], inverse


class WordEncoder:
    """ortflow's BPE: split into words as SPLIT_PATTERN does (the tokenizer's own first step, here with numpy byte
    classes), encode each distinct word once with `tokenizers`, and look the rest up. Gives the same ids as
    encoding the whole text.

    Words of up to 15 bytes (98% of them in the benchmark's corpus of text and code) are looked up once per
    distinct word in a chunk, by an exact integer key: their bytes and their length packed into 64 bits (up to 7
    bytes) or 128; longer words by their bytes. The words' ids live in one flat array
    (`flat[starts[w]:starts[w] + lengths[w]]` for word number w), so a chunk is assembled with a few numpy gathers
    instead of a Python loop over its ids."""

    MAX_WORDS = 1_000_000  # the word table is cleared when it grows past this

    def __init__(self, tokenizer, separator: int | None, dtype: str) -> None:
        self.tokenizer, self.dtype = tokenizer, np.dtype(dtype)
        self.separator = [] if separator is None else [separator]
        self._reset()

    def _reset(self) -> None:
        self.number: dict[int | bytes, int] = {}  # a word's key (short) or bytes (long) -> its number; 0: separator
        self.words = 1
        self.flat = np.array(self.separator, dtype=self.dtype)
        self.starts = np.zeros(1, dtype=np.int64)
        self.lengths = np.array([len(self.separator)], dtype=np.int64)

    def _add(self, keys: list[int | bytes], words: list[bytes]) -> None:
        encoded = _encode_batch(self.tokenizer, [w.decode("utf-8", errors="replace") for w in words])
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        base = len(self.flat)
        self.starts = np.concatenate([self.starts, base + np.cumsum(lengths) - lengths])
        self.lengths = np.concatenate([self.lengths, lengths])
        self.flat = np.concatenate([self.flat, np.fromiter(itertools.chain.from_iterable(encoded), dtype=self.dtype)])
        self.number.update(zip(keys, range(self.words, self.words + len(keys)), strict=True))
        self.words += len(keys)

    def _numbers(self, text: bytes, buf: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The word number of each word of the text that starts at `starts` (adding the new words)."""
        ends = np.append(starts[1:], len(buf))
        lengths = ends - starts
        padded = np.concatenate([buf, np.zeros(16, dtype=np.uint8)])
        eight = np.ndarray((len(buf) + 8,), dtype="<u8", buffer=padded.data, strides=(1,))  # 8 bytes from each byte
        groups = [np.flatnonzero(lengths <= _SHORT), np.flatnonzero((lengths > _SHORT) & (lengths <= 2 * _SHORT + 1))]
        keys: list[int | bytes] = []
        inverses = []
        firsts = []
        for group, at in enumerate(groups):
            n = lengths[at]
            length = n.astype(np.uint64) << np.uint64(56)
            head = eight[starts[at]]
            if group == 0:  # the key: the bytes and the length
                head = (head & _MASKS[n]) | length
                first, inverse = _distinct(head)
                keys += head[first].tolist()
            else:  # the key: the first 8 bytes, then the rest and the length
                tail = length | (eight[starts[at] + 8] & _MASKS[n - 8])
                first, inverse = _distinct(head, tail)
                keys += [h | (t << 64) for h, t in zip(head[first].tolist(), tail[first].tolist(), strict=True)]
            firsts.append(at[first])
            inverses.append(inverse + (len(keys) - len(first)))
        long_at = np.flatnonzero(lengths > 2 * _SHORT + 1)
        long_words = [text[s:e] for s, e in zip(starts[long_at].tolist(), ends[long_at].tolist(), strict=True)]
        numbers_of = list(map(self.number.get, keys + long_words))
        missing = [i for i, n in enumerate(numbers_of) if n is None]
        if missing:
            word_at = np.concatenate([*firsts, long_at]).tolist()
            new = {}  # a long word may be missing several times
            for i in missing:
                key = keys[i] if i < len(keys) else long_words[i - len(keys)]
                new.setdefault(key, text[starts[word_at[i]] : ends[word_at[i]]])
            self._add(list(new), list(new.values()))
            numbers_of = list(map(self.number.__getitem__, keys + long_words))
        table = np.array(numbers_of, dtype=np.int64)
        numbers = np.empty(len(starts), dtype=np.int64)
        for at, inverse in zip(groups, inverses, strict=True):
            numbers[at] = table[inverse]
        numbers[long_at] = table[len(keys) :]
        return numbers

    def __call__(self, chunk: Chunk) -> np.ndarray:
        if self.words > self.MAX_WORDS:
            self._reset()
        texts = [text for text, _ in chunk if text]
        if not texts:
            numbers = np.zeros(sum(separate for _, separate in chunk), dtype=np.int64)
        else:
            text = b"".join(texts)
            buf = np.frombuffer(text, dtype=np.uint8)
            sizes = np.array([len(t) for t, _ in chunk], dtype=np.int64)
            segment_starts = np.cumsum(sizes) - sizes
            starts = split_words(buf, segment_starts[sizes > 0])  # increasing: empty segments dropped
            numbers = self._numbers(text, buf, starts)
            separated = [i for i, (_, separate) in enumerate(chunk) if separate]
            if separated:  # the separator (word 0) goes before the first word of its segment
                numbers = np.insert(numbers, np.searchsorted(starts, segment_starts[separated]), 0)
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
