"""Where language-model text comes from, and what identifies it cheaply.

`data.source` names one of: the embedded corpus (`python_docs`), a text file, a folder (every non-hidden file under
it, recursively, in sorted order, each one a document), a JSON-lines file, a parquet file (both with the text in
`data.text_field`), or a dataset saved with Hugging Face `datasets.save_to_disk` (a folder holding its
`dataset_info.json`/`state.json`, or a `DatasetDict` with `dataset_dict.json`). Inside a folder, `.jsonl`/`.ndjson`
and `.parquet` files are read as records, everything else as text.

`resolve` checks every file without opening it for reading (a FIFO or a device would block or never end) and
returns a `Sources`: the files with their size, mtime and a hash of sampled bytes (fast on large files: it keys the
prepare cache). `documents` then yields the text, one document at a time, as blocks of UTF-8 bytes.
"""

import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ortflow.errors import DataError

EMBEDDED = "python_docs"
TEXT, JSONL, PARQUET, ARROW = "text", "jsonl", "parquet", "arrow"
RECORD_SUFFIXES = {".jsonl": JSONL, ".ndjson": JSONL, ".parquet": PARQUET}
DATA_EXTRA = "pip install 'ortflow[data]'"
BLOCK = 4 * 2**20  # bytes read from a text file at a time
SAMPLE = 64 * 2**10  # bytes hashed at the start, middle and end of a file for its quick identity
BINARY_PROBE = 8192  # a NUL byte in a file's first 8 KB marks it as binary (git's and grep's rule)


@dataclass(frozen=True)
class SourceFile:
    path: Path
    format: str  # TEXT, JSONL, PARQUET or ARROW (a file of a saved Hugging Face dataset)
    size: int
    mtime_ns: int


@dataclass
class Sources:
    """The files behind `data.source` (none for the embedded corpus), checked to exist and be regular files.

    Attributes:
        spec: data.source as given.
        kind: "embedded", "text", "folder", "jsonl", "parquet" or "hf_dataset".
        root: the file or folder data.source names (None for the embedded corpus).
        files: the files read, in reading order.
        text_field: the record field holding the text (JSON lines, parquet, datasets).
        dataset_split: the split of a saved DatasetDict that is read (None otherwise).
    """

    spec: str
    kind: str
    root: Path | None
    files: list[SourceFile] = field(default_factory=list)
    text_field: str = "text"
    dataset_split: str | None = None

    @property
    def size(self) -> int:
        """Bytes on disk (the embedded corpus: its UTF-8 bytes): what the progress bar counts."""
        return len(embedded_corpus()) if self.kind == "embedded" else sum(f.size for f in self.files)

    @property
    def has_records(self) -> bool:
        return any(f.format != TEXT for f in self.files)

    def relative(self, file: SourceFile) -> str:
        if self.root is None or self.root == file.path:
            return file.path.name
        return str(file.path.relative_to(self.root))

    def quick_identity(self) -> list[dict]:
        """What keys the cache: each file's relative path, size, mtime and a hash of sampled bytes (cheap to
        recompute on every run, however large the files)."""
        if self.kind == "embedded":
            return [{"path": EMBEDDED, "sha256": hashlib.sha256(embedded_corpus()).hexdigest()}]
        return [
            {"path": self.relative(f), "size": f.size, "mtime_ns": f.mtime_ns, "sample": sampled_hash(f.path, f.size)}
            for f in self.files
        ]

    def content_identity(self) -> list[dict]:
        """What the manifest records: each file's relative path, size and full SHA-256 (one read of every file)."""
        if self.kind == "embedded":
            return self.quick_identity()
        return [
            {"path": self.relative(f), "format": f.format, "size": f.size, "sha256": file_sha256(f.path)}
            for f in self.files
        ]


def embedded_corpus() -> bytes:
    """CPython's documentation text (`pydoc_data.topics`), present in every Python installation."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


def sampled_hash(path: Path, size: int) -> str:
    """BLAKE2b of the size and the first, middle and last 64 KB: changes with any edit of a file's length or of
    those bytes (the mtime catches the rest)."""
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with path.open("rb") as f:
        for offset in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
            f.seek(offset)
            digest.update(f.read(SAMPLE))
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _stat(path: Path, what: str) -> os.stat_result:
    try:
        return path.stat()
    except FileNotFoundError:
        raise DataError(
            f"data.source: {what} '{path}' does not exist. Give an existing file or folder, e.g. "
            f"data.source=/abs/path/corpus.txt, or data.source={EMBEDDED} for the embedded corpus."
        ) from None
    except OSError as err:
        raise DataError(f"data.source: cannot read {what} '{path}': {err.strerror}.") from None


def _regular(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise DataError(
            f"data.source: '{path}' is not a regular file (a pipe, socket or device would block or never end); "
            "give a text file on disk."
        )


def _source_file(path: Path, info: os.stat_result) -> SourceFile:
    fmt = RECORD_SUFFIXES.get(path.suffix.lower(), TEXT)
    return SourceFile(path, fmt, info.st_size, info.st_mtime_ns)


def _is_hf_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _walk(folder: Path) -> list[SourceFile]:
    """Every non-hidden file under `folder`, recursively, sorted by relative path (document order is stable)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            info = _stat(path, "file")
            _regular(path, info)
            found.append(_source_file(path, info))
    return sorted(found, key=lambda f: f.path.relative_to(folder).parts)


def _hf_dataset_files(folder: Path) -> tuple[list[SourceFile], str | None]:
    """The files of a saved dataset (its .arrow data and its json descriptions) and, for a DatasetDict, the split
    read: `train` if it has one, else its only split."""
    split = None
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"data.source: '{folder / 'dataset_dict.json'}' cannot be read ({err}).") from None
        if "train" in splits:
            split = "train"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise DataError(
                f"data.source: the saved DatasetDict '{folder}' has the splits {splits} and no 'train'; give one "
                f"split's folder, e.g. data.source={folder / splits[0]}."
            )
    base = folder / split if split else folder
    files = [
        SourceFile(p, ARROW, (info := p.stat()).st_size, info.st_mtime_ns)
        for p in sorted(base.iterdir())
        if p.is_file() and (p.suffix == ".arrow" or p.name in ("state.json", "dataset_info.json"))
    ]
    return files, split


def resolve(spec: str, text_field: str = "text") -> Sources:
    """The checked sources `data.source` names.

    Raises:
        DataError: the source is empty, missing, unreadable, not a regular file (FIFO, device), or a folder
            holding no file.
    """
    if not spec.strip():
        raise DataError(f"data.source is empty; give a text file or folder, or data.source={EMBEDDED}.")
    if spec == EMBEDDED:
        return Sources(spec, "embedded", None)
    root = Path(spec).expanduser().absolute()
    info = _stat(root, "text file")
    if stat.S_ISDIR(info.st_mode):
        if _is_hf_dataset(root):
            files, split = _hf_dataset_files(root)
            return Sources(spec, "hf_dataset", root, files, text_field, split)
        files = _walk(root)
        if not files:
            raise DataError(
                f"data.source: the folder '{root}' holds no files (hidden files are skipped); give a folder of text "
                "files, or one text file."
            )
        return Sources(spec, "folder", root, files, text_field)
    _regular(root, info)
    if info.st_size == 0:
        raise DataError(f"data.source: text file '{root}' is empty.")
    file = _source_file(root, info)
    return Sources(spec, file.format if file.format != TEXT else "text", root, [file], text_field)


# ----------------------------------------------------------------------------------------------------- reading
Document = Iterator[bytes]  # one document's UTF-8 text, in blocks


def documents(sources: Sources, advance: Callable[[int], None]) -> Iterator[Document]:
    """Every document of the sources in order; `advance(n)` is told the source bytes read, for progress.

    Raises:
        DataError: a binary file, a record without the text field, a line that is not JSON, or a missing
            optional dependency (parquet, datasets).
    """
    if sources.kind == "embedded":
        corpus = embedded_corpus()
        advance(len(corpus))
        yield iter((corpus,))
        return
    if sources.kind == "hf_dataset":
        yield from _hf_dataset(sources, advance)
        return
    for file in sources.files:
        if file.format == TEXT:
            yield _text_file(file.path, advance)
        elif file.format == JSONL:
            yield from _jsonl(file.path, sources.text_field, advance)
        elif file.format == PARQUET:
            yield from _parquet(file.path, sources.text_field, advance)


def _text_file(path: Path, advance: Callable[[int], None]) -> Document:
    try:
        with path.open("rb") as f:
            first = True
            while block := f.read(BLOCK):
                if first and b"\0" in block[:BINARY_PROBE]:
                    raise DataError(
                        f"data.source: '{path}' looks binary (a NUL byte in its first {BINARY_PROBE} bytes), not "
                        "text; remove it from the source or give a text file."
                    )
                first = False
                advance(len(block))
                yield block
    except OSError as err:
        raise DataError(f"data.source: cannot read '{path}': {err.strerror}.") from None


def _missing_field(path: Path, where: str, text_field: str, fields: list[str]) -> DataError:
    return DataError(
        f"data.source: '{path}' {where} has no field '{text_field}' (data.text_field); its fields are {fields}. "
        f"Set data.text_field to the field that holds the text."
    )


def _jsonl(path: Path, text_field: str, advance: Callable[[int], None]) -> Iterator[Document]:
    try:
        with path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                advance(len(line))
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise DataError(
                        f"data.source: '{path}' line {number} is not JSON ({err}); give a JSON-lines file, one "
                        "object per line."
                    ) from None
                if not isinstance(record, dict) or text_field not in record:
                    fields = sorted(record) if isinstance(record, dict) else []
                    raise _missing_field(path, f"line {number}", text_field, fields)
                text = record[text_field]
                if not isinstance(text, str):
                    raise DataError(
                        f"data.source: '{path}' line {number}: field '{text_field}' (data.text_field) holds "
                        f"{type(text).__name__}, not text."
                    )
                if text:
                    yield iter((text.encode("utf-8"),))
    except OSError as err:
        raise DataError(f"data.source: cannot read '{path}': {err.strerror}.") from None


def _texts(column, path: Path, text_field: str) -> Iterator[Document]:
    for text in column.to_pylist():
        if text is None:
            continue
        if not isinstance(text, str):
            raise DataError(
                f"data.source: '{path}': column '{text_field}' (data.text_field) holds {type(text).__name__}, not text."
            )
        if text:
            yield iter((text.encode("utf-8"),))


def _parquet(path: Path, text_field: str, advance: Callable[[int], None]) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"data.source: reading parquet ('{path}') needs pyarrow: {DATA_EXTRA}.") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's own error types for a file that is not parquet
        raise DataError(f"data.source: '{path}' is not a readable parquet file ({err}).") from None
    names = file.schema_arrow.names
    if text_field not in names:
        raise _missing_field(path, "(parquet)", text_field, names)
    rows = max(file.metadata.num_rows, 1)
    size, done = path.stat().st_size, 0
    for batch in file.iter_batches(batch_size=1024, columns=[text_field]):
        yield from _texts(batch.column(0), path, text_field)
        share = size * (done + batch.num_rows) // rows - size * done // rows
        done += batch.num_rows
        advance(share)


def _hf_dataset(sources: Sources, advance: Callable[[int], None]) -> Iterator[Document]:
    root = sources.root
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.source: reading a saved dataset ('{root}') needs datasets: {DATA_EXTRA}.") from None
    try:
        dataset = datasets.load_from_disk(str(root))
    except Exception as err:  # datasets raises several types for a folder it cannot load
        raise DataError(f"data.source: '{root}' cannot be loaded with datasets.load_from_disk ({err}).") from None
    if sources.dataset_split is not None:
        dataset = dataset[sources.dataset_split]
    if sources.text_field not in dataset.column_names:
        raise _missing_field(root, "(a saved dataset)", sources.text_field, dataset.column_names)
    rows = max(len(dataset), 1)
    size, done = sources.size, 0
    for batch in dataset.select_columns([sources.text_field]).with_format("arrow").iter(batch_size=1024):
        yield from _texts(batch.column(0), root, sources.text_field)
        share = size * (done + batch.num_rows) // rows - size * done // rows
        done += batch.num_rows
        advance(share)
