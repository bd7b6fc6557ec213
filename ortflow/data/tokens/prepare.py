"""Prepare once, stream from disk: raw text in, a fingerprinted token store out (ortflow/data/tokens/store.py).

`prepare(settings)` reads the sources, builds the tokenizer (trains a BPE on a bounded, evenly spread sample of the
corpus), encodes the corpus in chunks on `data.num_proc` processes, holds out the last `data.val_fraction` of its
bytes (at a chunk boundary) as the validation split, and writes `train.bin`, `val.bin`, `tokenizer.json` and, last,
`manifest.json`, which records each token file's block checksums (ortflow/data/tokens/checksums.py).

The store's folder is `<cache>/<key>`, the key a hash of the sources' quick identity (relative path, size, mtime,
sampled bytes) and of the settings, so preparing the same sources with the same settings again finds it and does
nothing. Everything is written into a hidden temporary folder beside it that becomes `<key>` by one rename; a
killed or failed prepare leaves only that hidden folder, which the next prepare of the same key removes. A file
lock per key makes concurrent prepares (two commands, DDP ranks) wait for one another instead of racing.
`force` (`ortflow-prepare --force`) prepares again a store the cache holds, one whose files changed: the new one
replaces it by a rename once complete.
"""

import errno
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ortflow.data.tokens import checksums, encode, sources
from ortflow.data.tokens.store import FORMAT, MANIFEST, TOKENIZER_FILE, VERSION, TokenArray, TokenStore, fingerprint
from ortflow.data.tokens.tokenizer import BYTES, ByteTokenizer, HFTokenizer, Tokenizer, choose, token_dtype, train_bpe
from ortflow.errors import DataError

log = logging.getLogger(__name__)

SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
SHOW_FROM = 16 * 2**20  # sources at least this large get a progress bar (a terminal) or progress lines (a log)
LINE_EVERY_S = 10.0
POOL_FROM = 8 * 2**20  # smaller corpora encode in this process: starting workers would cost more than it saves
COPY_BLOCK = 16 * 2**20


@dataclass(frozen=True)
class PrepareSettings:
    """The `data.*` keys that decide the prepared tokens (see ortflow/config.py: TextDataConfig)."""

    source: str
    tokenizer: str = BYTES
    bpe_vocab_size: int = 8192
    bpe_train_bytes: int = 100_000_000
    val_fraction: float = 0.1
    text_field: str = "text"
    cache_dir: str | None = None
    num_proc: int | None = None

    @classmethod
    def from_config(cls, data: Mapping[str, Any]) -> "PrepareSettings":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/ortflow/tokens`, else `~/.cache/ortflow/tokens`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ortflow" / "tokens"


def cache_root(settings: PrepareSettings) -> Path:
    return Path(settings.cache_dir).expanduser().absolute() if settings.cache_dir else default_cache_dir()


def processes(settings: PrepareSettings) -> int:
    """data.num_proc, else the CPUs this process may run on."""
    return settings.num_proc or len(os.sched_getaffinity(0))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def cache_key(src: sources.Sources, settings: PrepareSettings, tokenizer_identity: dict) -> str:
    """The store's folder name: the sources' quick identity and every setting that changes the tokens."""
    return _digest(
        {
            "version": VERSION,
            "kind": src.kind,
            "files": src.quick_identity(),
            "text_field": settings.text_field if src.has_records or src.kind == "hf_dataset" else None,
            "split": src.dataset_split,
            "tokenizer": tokenizer_identity,
            "val_fraction": settings.val_fraction,
        }
    )[:20]


# ----------------------------------------------------------------------------------------------------- progress
class Progress:
    """Source bytes read and the rate: a rich bar on a terminal, a plain line every 10 s otherwise; nothing for
    small sources (they take a moment)."""

    def __init__(self, label: str, total: int, say: Callable[[str], None]) -> None:
        from ortflow.report.terminal import console

        self.label, self.total, self.say = label, max(total, 1), say
        self.done, self.started, self.last_line = 0, time.monotonic(), time.monotonic()
        self.shown = total >= SHOW_FROM
        self.bar = None
        if self.shown and console().is_terminal:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as Bar

            self.bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=console(),
                transient=True,
            )
            self.task = self.bar.add_task(label, total=self.total)
            self.bar.start()

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
        elif self.shown and time.monotonic() - self.last_line >= LINE_EVERY_S:
            self.last_line = time.monotonic()
            self.say(f"{self.label}: {self.done / 2**20:,.0f} of {self.total / 2**20:,.0f} MiB, {self.rate():.1f} MB/s")

    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.started, 1e-9) / 1e6

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def say_on_console(text: str) -> None:
    from ortflow.report.terminal import console

    console().print(text, markup=False, highlight=False)


# ----------------------------------------------------------------------------------------------------- writing
def write_tokens(file: BinaryIO, tokens: np.ndarray) -> None:
    """Append tokens to an open token file (one place, so a test can make the disk fill here)."""
    file.write(tokens.tobytes())


@dataclass
class Encoded:
    """What encoding the corpus gave: per chunk its bytes and tokens, the documents, the token counts."""

    chunk_bytes: list[int]
    chunk_tokens: list[int]
    counts: np.ndarray  # occurrences of each token id, the whole corpus

    @property
    def total_bytes(self) -> int:
        return sum(self.chunk_bytes)


def _encoded_chunks(
    src: sources.Sources, tokenizer: Tokenizer, dtype: np.dtype, num_proc: int, progress: Progress
) -> Iterator[tuple[encode.Chunk, np.ndarray]]:
    """(chunk, its tokens) in corpus order; on `num_proc` worker processes for large corpora (tokenizer work only:
    the byte tokenizer is a copy, faster here than any pool)."""
    size = encode.chunk_size(src.size)
    chunks = encode.chunks(sources.documents(src, progress), size)
    args = (tokenizer.kind, tokenizer.json, tokenizer.separator, dtype.name)
    if tokenizer.kind == BYTES or num_proc <= 1 or src.size < POOL_FROM:
        encoder = encode.make_encoder(*args)
        for chunk in chunks:
            yield chunk, encoder(chunk)
        return
    import multiprocessing

    # spawn: the workers import only ortflow.data.tokens.encode (no torch), and no lock or thread of this process
    # leaks in.
    with multiprocessing.get_context("spawn").Pool(num_proc, encode.init_worker, args) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(encode.encode_in_worker, (chunk,))))
            if len(pending) >= 4 * num_proc:  # bounded: the corpus is never held in memory
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


def _encode_to(
    write: Callable[[np.ndarray], None],
    src: sources.Sources,
    tokenizer: Tokenizer,
    dtype: np.dtype,
    num_proc: int,
    progress: Progress,
) -> Encoded:
    """Encode the corpus, handing each chunk's tokens to `write` in corpus order."""
    encoded = Encoded([], [], np.zeros(tokenizer.vocab_size, dtype=np.int64))
    for chunk, tokens in _encoded_chunks(src, tokenizer, dtype, num_proc, progress):
        write(tokens)
        encoded.chunk_bytes.append(encode.chunk_bytes(chunk))
        encoded.chunk_tokens.append(len(tokens))
        counts = np.bincount(tokens, minlength=tokenizer.vocab_size)
        encoded.counts[: len(counts)] += counts
    if encoded.total_bytes == 0:
        raise DataError(f"data.source: '{src.spec}' holds no text (every file or record is empty).")
    return encoded


def split_point(encoded: Encoded, val_fraction: float, spec: str) -> int:
    """The chunk where the validation split starts: the boundary whose tail is closest to val_fraction of the
    bytes, keeping at least one chunk on each side.

    Raises:
        DataError: the corpus is one chunk (under about 256 bytes): too small to hold anything out.
    """
    n = len(encoded.chunk_bytes)
    if n < 2:
        raise DataError(
            f"data.source: '{spec}' has {encoded.total_bytes:,} bytes, too few to hold out a validation split "
            f"(data.val_fraction={val_fraction}); use a larger corpus."
        )
    target = encoded.total_bytes * (1 - val_fraction)
    cumulative = np.cumsum(encoded.chunk_bytes)[:-1]  # bytes before boundary 1..n-1
    return int(np.argmin(np.abs(cumulative - target))) + 1


def _unigram_entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(
    settings: PrepareSettings, src: sources.Sources, say: Callable[[str], None], timings: dict[str, float]
) -> tuple[Tokenizer, dict]:
    """The tokenizer data.tokenizer names and what the manifest records about how it was made (its training time
    goes to `timings`: not part of the content)."""
    choice = choose(settings.tokenizer)
    if choice.kind == BYTES:
        return ByteTokenizer(), {}
    if choice.kind == "file":
        return HFTokenizer.from_file(choice.path), {"source_file": str(choice.path)}
    total = src.size
    progress = Progress("sampling text for the BPE tokenizer", min(total, settings.bpe_train_bytes), say)
    taken = 0

    def texts() -> Iterator[str]:
        nonlocal taken
        documents = sources.documents(src, lambda n: None)
        for text in encode.sample(encode.chunks(documents, encode.chunk_size(total)), total, settings.bpe_train_bytes):
            taken += len(text)
            progress(len(text))
            yield text

    started = time.monotonic()
    try:
        tokenizer = train_bpe(texts(), settings.bpe_vocab_size)
    finally:
        progress.close()
    made = {
        "trained_on_chars": taken,
        "corpus_bytes_on_disk": total,
        "sampled": total > settings.bpe_train_bytes,
        "sample_budget_bytes": settings.bpe_train_bytes,
        "requested_vocab_size": settings.bpe_vocab_size,
    }
    timings["tokenizer_train_seconds"] = round(time.monotonic() - started, 2)
    if tokenizer.vocab_size < settings.bpe_vocab_size:
        log.info(
            "the corpus ran out of pairs to merge: BPE vocabulary %d < %d",
            tokenizer.vocab_size,
            settings.bpe_vocab_size,
        )
    return tokenizer, made


# ----------------------------------------------------------------------------------------------------- manifest
def _manifest(
    settings: PrepareSettings,
    src: sources.Sources,
    files: list[dict],
    tokenizer: Tokenizer,
    made: dict,
    encoded: Encoded,
    split: int,
    dtype: np.dtype,
    seconds: float,
    num_proc: int,
    key: str | None,
    sums: dict[str, dict] | None = None,
) -> dict[str, Any]:
    train_tokens = sum(encoded.chunk_tokens[:split])
    val_tokens = sum(encoded.chunk_tokens[split:])
    train_bytes, val_bytes = sum(encoded.chunk_bytes[:split]), sum(encoded.chunk_bytes[split:])
    recorded = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "separator": tokenizer.separator, **made}
    if tokenizer.json is not None:
        recorded |= {"file": TOKENIZER_FILE, "sha256": hashlib.sha256(tokenizer.json.encode()).hexdigest()}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "ortflow_version": importlib.metadata.version("ortflow"),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "cache_key": key,
        "source": {
            "spec": src.spec,
            "kind": src.kind,
            "root": str(src.root) if src.root else None,
            "text_field": settings.text_field if src.has_records or src.kind == "hf_dataset" else None,
            "dataset_split": src.dataset_split,
            "files": files,
        },
        "tokenizer": recorded,
        "dtype": dtype.name,
        "splits": {
            "train": {"file": SPLIT_FILES["train"], "tokens": train_tokens, "bytes": train_bytes},
            "val": {"file": SPLIT_FILES["val"], "tokens": val_tokens, "bytes": val_bytes},
        },
        "val_fraction": settings.val_fraction,
        "val_fraction_actual": round(val_bytes / (train_bytes + val_bytes), 6),
        "unigram_entropy": _unigram_entropy(encoded.counts),
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("source", "cache_dir", "num_proc")},
        "prepare": {"seconds": round(seconds, 3), "num_proc": num_proc, "mb_per_s": round(src.size / seconds / 1e6, 2)},
    }
    for name, recorded in (sums or {}).items():
        manifest["splits"][name]["checksums"] = recorded
    manifest["fingerprint"] = fingerprint(manifest)
    return manifest


# ------------------------------------------------------------------------------------------------------ prepare
@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (released when the process dies, so a killed prepare never blocks the next)."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process preparing the same data (lock %s)", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _valid(folder: Path) -> TokenStore | None:
    return TokenStore.open(folder) if (folder / MANIFEST).is_file() else None


def prepare(settings: PrepareSettings, say: Callable[[str], None] = say_on_console, force: bool = False) -> TokenStore:
    """The prepared store for `settings`: found in the cache, or made there (one line said when it is made);
    `force`: made again even when the cache holds it (replacing it once the new one is complete).

    Raises:
        DataError: a bad source or tokenizer (named), a cache folder that cannot be written, a full disk (the
            temporary files are removed; nothing prepared before is touched), a corrupt store in the cache.
    """
    src = sources.resolve(settings.source, settings.text_field)
    choice = choose(settings.tokenizer)
    if choice.kind == "file":  # a file that does not load is refused before the cache is touched
        HFTokenizer.from_file(choice.path)
    key = cache_key(src, settings, choice.identity(settings.bpe_vocab_size, settings.bpe_train_bytes))
    root = cache_root(settings)
    target = root / key
    if not force and (found := _valid(target)):
        log.info("data: '%s' is prepared in %s (cache hit)", settings.source, target)
        return found
    lock = _lock_file(root, key)
    with _locked(lock):
        if not force and (found := _valid(target)):  # another process prepared it while this one waited
            return found
        for stale in [*root.glob(f".{key}.tmp-*"), *root.glob(f".{key}.old-*")]:  # left by a killed prepare
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        try:
            manifest = _prepare_into(work, settings, src, key, say)
            _move_into_place(work, target, root, key)
        except BaseException as err:
            shutil.rmtree(work, ignore_errors=True)
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                where = err.filename or work
                raise DataError(
                    f"data: disk full while preparing '{settings.source}' (writing '{where}'). The partial files were "
                    f"removed; free space on that disk or set data.cache_dir to a folder on a larger one, and run "
                    "again."
                ) from None
            if isinstance(err, OSError) and not isinstance(err, DataError):
                raise DataError(f"data: cannot write prepared tokens into '{work}' ({err}).") from None
            raise
    _say_prepared(say, settings, src, manifest, target)
    return TokenStore.open(target)


def _lock_file(root: Path, key: str) -> Path:
    """Create the cache folder and the lock file that guards the store `key` in it.

    Raises:
        DataError: the cache folder cannot be written.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = root / f".{key}.lock"
        lock.touch()
    except OSError as err:
        raise DataError(
            f"data.cache_dir: cannot write the token cache '{root}' ({err.strerror}); set data.cache_dir to a "
            "writable folder."
        ) from None
    return lock


def _move_into_place(work: Path, target: Path, root: Path, key: str) -> None:
    """Rename the finished store `work` to `target`, replacing (then removing) one already there, and sync the
    cache folder."""
    if target.exists():  # --force: the store it replaces goes once the new one is in place
        replaced = Path(tempfile.mkdtemp(prefix=f".{key}.old-", dir=root))
        os.rename(target, replaced / key)
        os.rename(work, target)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        os.rename(work, target)
    _fsync_dir(root)


def _say_prepared(
    say: Callable[[str], None], settings: PrepareSettings, src: sources.Sources, manifest: dict[str, Any], target: Path
) -> None:
    """Say what was prepared: the source and its size, the tokenizer, the token counts, the speed and the folder."""
    size = src.size
    say(
        f"data: prepared '{settings.source}' ({size / 1e6:,.1f} MB) with tokenizer {manifest['tokenizer']['kind']} "
        f"(vocabulary {manifest['tokenizer']['vocab_size']:,}): {manifest['splits']['train']['tokens']:,} train / "
        f"{manifest['splits']['val']['tokens']:,} val tokens in {manifest['prepare']['seconds']:.1f} s "
        f"({manifest['prepare']['mb_per_s']:.1f} MB/s) -> {target}"
    )


def _prepare_into(
    work: Path, settings: PrepareSettings, src: sources.Sources, key: str, say: Callable[[str], None]
) -> dict[str, Any]:
    started = time.monotonic()
    timings: dict[str, float] = {}
    tokenizer, made = build_tokenizer(settings, src, say, timings)
    dtype = token_dtype(tokenizer.vocab_size)
    num_proc = processes(settings)
    progress = Progress(f"preparing {Path(settings.source).name}", src.size, say)
    train_path, val_path = work / SPLIT_FILES["train"], work / SPLIT_FILES["val"]
    try:
        with train_path.open("w+b") as out:
            encoded = _encode_to(_Writer(out, train_path).write, src, tokenizer, dtype, num_proc, progress)
            split = split_point(encoded, settings.val_fraction, settings.source)
            cut = sum(encoded.chunk_tokens[:split]) * dtype.itemsize
            with val_path.open("wb") as val:  # the tail becomes val.bin; train.bin keeps the head
                out.seek(cut)
                writer = _Writer(val, val_path)
                while block := out.read(COPY_BLOCK):
                    writer.write(block)
                val.flush()
                os.fsync(val.fileno())
            out.truncate(cut)
            out.flush()
            os.fsync(out.fileno())
    finally:
        progress.close()
    if tokenizer.json is not None:
        _write_text(work / TOKENIZER_FILE, tokenizer.json)
    files = src.content_identity()  # a full read of every source file: timed with the rest
    sums = {name: checksums.of_file(work / SPLIT_FILES[name]) for name in SPLIT_FILES}  # the files as written
    seconds = time.monotonic() - started
    manifest = _manifest(settings, src, files, tokenizer, made, encoded, split, dtype, seconds, num_proc, key, sums)
    manifest["prepare"] |= timings
    _write_text(work / MANIFEST, json.dumps(manifest, indent=2))  # last: a folder with a manifest is complete
    return manifest


class _Writer:
    """A token file's writer: every write goes through `write_tokens`, and an OSError names the file."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file, self.path = file, path

    def write(self, data: np.ndarray | bytes) -> None:
        try:
            write_tokens(self.file, np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data)
        except OSError as err:
            err.filename = err.filename or str(self.path)
            raise


def _write_text(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        try:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        except OSError as err:
            err.filename = err.filename or str(path)
            raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_in_memory(settings: PrepareSettings) -> TokenStore:
    """The embedded corpus with the byte tokenizer, tokenized in memory (466 KB, a few milliseconds): the default
    run writes nothing outside its run dir. The manifest is the one `prepare` would write."""
    started = time.monotonic()
    src = sources.resolve(settings.source, settings.text_field)
    tokenizer = ByteTokenizer()
    dtype = token_dtype(tokenizer.vocab_size)
    parts: list[np.ndarray] = []
    encoded = _encode_to(parts.append, src, tokenizer, dtype, 1, Progress("", 0, say_on_console))
    split = split_point(encoded, settings.val_fraction, settings.source)
    tokens = np.concatenate(parts)
    cut = sum(encoded.chunk_tokens[:split])
    seconds = time.monotonic() - started
    manifest = _manifest(settings, src, src.content_identity(), tokenizer, {}, encoded, split, dtype, seconds, 1, None)
    train = TokenArray(cut, dtype.name, array=tokens[:cut])
    val = TokenArray(len(tokens) - cut, dtype.name, array=tokens[cut:])
    return TokenStore(manifest, train, val, tokenizer)


def open_or_prepare(
    settings: PrepareSettings, say: Callable[[str], None] = say_on_console, force: bool = False
) -> TokenStore:
    """What a run trains on: a prepared folder named by data.source, the embedded corpus in bytes in memory, or
    anything else prepared into (or found in) the cache; `force`: prepared again (not a prepared folder: its
    source is needed).

    Raises:
        DataError: as `prepare`; `force` with data.source a prepared folder.
    """
    folder = Path(settings.source).expanduser()
    if settings.source.strip() and folder.is_dir() and (folder / MANIFEST).is_file():
        if force:
            raise DataError(
                f"data.source: '{folder}' is a prepared token folder, which --force cannot prepare again by itself: "
                f"pass the text it was prepared from ({_source_of(folder)}) as data.source, with the same data.* "
                "settings."
            )
        return TokenStore.open(folder.absolute())
    if settings.source == sources.EMBEDDED and settings.tokenizer == BYTES:
        return prepare_in_memory(settings)
    return prepare(settings, say, force)


def _source_of(folder: Path) -> str:
    """The source a prepared folder's manifest names, as well as it can be read."""
    try:
        return f"data.source={json.loads((folder / MANIFEST).read_text())['source']['spec']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest.json names it under source.spec"
