"""A prepared token store: `manifest.json`, one token file per split and the tokenizer file, in one folder.

The manifest is written last and the folder appears under its final name by one rename, so a folder that has a
manifest is complete. Opening one checks it anyway: the format version, every token file's size against the
manifest's token count and dtype (a truncated file, or one of another dtype, is refused), the tokenizer file's
hash, and the manifest's own fingerprint. The token files' contents are checked block by block as they are read
(ortflow/data/tokens/checksums.py): a byte changed since the store was prepared stops the run naming the file and
the block.
"""

import hashlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ortflow.data.tokens.checksums import BlockChecks
from ortflow.data.tokens.tokenizer import BYTES, ByteTokenizer, HFTokenizer, Tokenizer
from ortflow.errors import DataError

# Version 2: each token file's block checksums in the manifest (a version 1 store has none: prepared again).
FORMAT, VERSION = "ortflow-tokens", 2
MANIFEST, TOKENIZER_FILE = "manifest.json", "tokenizer.json"
SPLITS = ("train", "val")
# Manifest keys left out of its fingerprint: when and by which version it was written, how fast, and the cache key
# (it holds file mtimes). The same content prepared again has the same fingerprint.
UNFINGERPRINTED = ("fingerprint", "created", "ortflow_version", "prepare", "cache_key")


def fingerprint(manifest: dict[str, Any]) -> str:
    """SHA-256 (first 16 hex digits) over the manifest's content: sources (relative paths, sizes, hashes), tokenizer
    and its hash, token and byte counts, settings, format. Not over where things are (the source's and the
    tokenizer file's absolute paths): the same text moved, or prepared on another machine, has the same fingerprint."""
    content = json.loads(json.dumps({k: v for k, v in manifest.items() if k not in UNFINGERPRINTED}))
    for section, key in (("source", "spec"), ("source", "root"), ("tokenizer", "source_file")):
        content.get(section, {}).pop(key, None)
    settings = content.get("settings", {})
    if settings.get("tokenizer") not in (None, "bytes", "bpe"):
        settings["tokenizer"] = "file"  # which file: its hash, in content["tokenizer"]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TokenArray:
    """One split's tokens: a file (never read whole: `rows` reads just the windows asked for, `open` maps it), or an
    array in memory (the embedded corpus). Picklable, for DataLoader workers. A file's blocks are checked against
    their prepared checksums (`checks`) before this process first reads them."""

    count: int
    dtype: str
    path: str | None = None
    array: np.ndarray | None = field(default=None, compare=False)
    checks: BlockChecks | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return self.count

    def open(self) -> np.ndarray:
        """The tokens as an array: a read-only np.memmap of the file (pages are read as they are touched, and stay
        in the process's RSS while the map lives), or the array in memory."""
        if self.array is not None:
            return self.array
        if self.checks is not None:
            self.checks.check_all()
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.count,))

    def check(self, starts: np.ndarray, length: int) -> None:
        """Check the blocks that hold tokens [start, start + length) for each start, those this process has not
        checked before (the rows of every rank of a step: each rank then stops at the same step).

        Raises:
            DataError: a block changed since the store was prepared, named with its file.
        """
        if self.checks is not None:
            self.checks.check_rows(starts, length, np.dtype(self.dtype).itemsize)

    def rows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Tokens [start, start + length) for each start, as a (len(starts), length) array. From a file, one
        positioned read per row: nothing stays mapped, so the process's memory does not grow with the corpus or with
        the batches drawn (a fresh np.memmap per batch does the same at 4x the cost: mapping and unmapping)."""
        if self.array is not None:
            return self.array[starts[:, None] + np.arange(length)]
        self.check(starts, length)
        itemsize = np.dtype(self.dtype).itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            buf = b"".join(os.pread(fd, length * itemsize, int(start) * itemsize) for start in starts)
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype=self.dtype).reshape(len(starts), length)


@dataclass
class TokenStore:
    """A prepared corpus: its manifest, both splits and the tokenizer that made them.

    Attributes:
        path: the prepared folder (None for the embedded corpus tokenized in memory).
    """

    manifest: dict[str, Any]
    train: TokenArray
    val: TokenArray
    tokenizer: Tokenizer
    path: Path | None = None

    @property
    def tokens_per_byte(self) -> float:
        """Of the validation split: what turns a loss per token into one per byte."""
        val = self.manifest["splits"]["val"]
        return val["tokens"] / val["bytes"]

    @classmethod
    def open(cls, folder: Path) -> "TokenStore":
        """Open and check a prepared folder.

        Raises:
            DataError: no or an unreadable manifest, a newer format version or one without checksums (version 1), a
                token file missing, truncated or of another dtype, a tokenizer file that does not match or does not
                load, a manifest edited by hand.
        """
        file = folder / MANIFEST
        try:
            manifest = json.loads(file.read_text())
        except FileNotFoundError:
            raise DataError(
                f"data.source: '{folder}' holds no {MANIFEST}; it is not a prepared token folder."
            ) from None
        except (OSError, ValueError) as err:
            raise DataError(f"data: the manifest '{file}' cannot be read ({err}).") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise DataError(f'data: \'{file}\' is not an ortflow token manifest (no "format": "{FORMAT}").')
        version = manifest.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise DataError(
                f"data: '{file}' has format version {version}, newer than this ortflow reads ({VERSION}); it was "
                f"prepared by ortflow {manifest.get('ortflow_version', '?')}. Upgrade ortflow, or delete '{folder}' "
                "and prepare again."
            )
        if version < VERSION:
            raise DataError(
                f"data: '{folder}' was prepared by ortflow {manifest.get('ortflow_version', '?')} (format version "
                f"{version}), whose manifest has no checksums of its token files: a byte changed in them would go "
                f"unnoticed. {prepare_again(manifest)}"
            )
        try:
            dtype = np.dtype(manifest["dtype"])
            splits = {name: manifest["splits"][name] for name in SPLITS}
            recorded = manifest["fingerprint"]
            kind = manifest["tokenizer"]["kind"]
        except (KeyError, TypeError) as err:
            raise DataError(f"data: the manifest '{file}' lacks {err}; delete '{folder}' and prepare again.") from None
        if fingerprint(manifest) != recorded:
            raise DataError(
                f"data: the manifest '{file}' does not match its fingerprint (edited after it was written); delete "
                f"'{folder}' and prepare again."
            )
        arrays = {name: _token_file(folder, split, dtype, prepare_again(manifest)) for name, split in splits.items()}
        tokenizer: Tokenizer = ByteTokenizer()
        if kind != BYTES:
            tokenizer = _tokenizer_file(folder, manifest["tokenizer"])
        return cls(manifest, arrays["train"], arrays["val"], tokenizer, folder)

    def run_files(self) -> dict[str, bytes]:
        """What a run dir keeps so that the run's tokenizer is found from it (ortflow-predict): the manifest and
        the tokenizer file."""
        files = {"data_manifest.json": json.dumps(self.manifest, indent=2).encode()}
        if self.tokenizer.json is not None:
            files[TOKENIZER_FILE] = self.tokenizer.json.encode()
        return files


def prepare_again(manifest: dict[str, Any]) -> str:
    """The fix for a store that cannot be trusted: the `ortflow-prepare --force` command that prepares it again from
    its source, with the data.* settings it was prepared with."""
    source, settings = manifest.get("source", {}), manifest.get("settings", {})
    keys = ["tokenizer", "val_fraction"] + (
        ["bpe_vocab_size", "bpe_train_bytes"] if settings.get("tokenizer") == "bpe" else []
    )
    overrides = [f"data.source={source.get('spec', '...')}"]
    overrides += [f"data.{key}={settings[key]}" for key in keys if key in settings]
    if source.get("text_field") not in (None, "text"):
        overrides.append(f"data.text_field={source['text_field']}")
    command = shlex.join(["ortflow-prepare", "--force", *overrides])
    return f"Prepare it again: `{command}` (add data.cache_dir=... if you set it), then run again."


def _token_file(folder: Path, split: dict[str, Any], dtype: np.dtype, fix: str) -> TokenArray:
    path = folder / split["file"]
    tokens = split["tokens"]
    try:
        size = path.stat().st_size
    except OSError:
        raise DataError(f"data: the token file '{path}' is missing; delete '{folder}' and prepare again.") from None
    if size != tokens * dtype.itemsize:
        raise DataError(
            f"data: the token file '{path}' has {size:,} bytes, but its manifest says {tokens:,} tokens of {dtype} "
            f"({tokens * dtype.itemsize:,} bytes): it is truncated or of another dtype. Delete '{folder}' and "
            "prepare again."
        )
    return TokenArray(tokens, dtype.name, str(path), checks=BlockChecks(str(path), size, split.get("checksums"), fix))


def _tokenizer_file(folder: Path, recorded: dict[str, Any]) -> HFTokenizer:
    path = folder / recorded.get("file", TOKENIZER_FILE)
    try:
        text = path.read_bytes()
    except OSError:
        raise DataError(f"data: the tokenizer file '{path}' is missing; delete '{folder}' and prepare again.") from None
    if hashlib.sha256(text).hexdigest() != recorded.get("sha256"):
        raise DataError(
            f"data: the tokenizer file '{path}' is not the one its manifest records (another SHA-256); delete "
            f"'{folder}' and prepare again."
        )
    return HFTokenizer.from_str(text.decode("utf-8", errors="replace"), str(path))
