"""A checksum per block of a token file: computed when the store is prepared, kept in its manifest, and checked in
each process before the first read of each block, so that a token file changed after it was prepared (a flipped
bit on disk, a file edited or copied over in place, same size) stops the run instead of training on other tokens.

Blocks are BLOCK_BYTES long (the last one shorter); the checksum is CRC-32 (zlib's, 1.8 GB/s on a loaded 2-core
AMD EPYC: a changed byte, or any change of up to 32 consecutive bits, is always caught; other changes are missed
once in 4 billion). The manifest keeps them as one hex string per file, 8 digits a block: 32 KB per GB of tokens.
Why a block is checked on first read rather than the whole file at start: docs/data.md ("Checked tokens").
"""

import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ortflow.errors import DataError

ALGORITHM = "crc32"
BLOCK_BYTES = 256 * 2**10
READ_BYTES = 16 * 2**20  # how much a whole-file pass reads at a time


def of_file(path: Path, block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """The manifest's record of `path`: {"algorithm", "block_bytes", "crc32": 8 hex digits per block}."""
    digits: list[str] = []
    with path.open("rb", buffering=0) as file:
        while chunk := file.read(max(READ_BYTES // block_bytes, 1) * block_bytes):
            digits += (f"{zlib.crc32(chunk[i : i + block_bytes]):08x}" for i in range(0, len(chunk), block_bytes))
    return {"algorithm": ALGORITHM, "block_bytes": block_bytes, ALGORITHM: "".join(digits)}


class BlockChecks:
    """The recorded checksums of one token file and which of its blocks this process has checked. Picklable (a
    DataLoader worker checks again what it reads: its own process, its own reads).

    Raises (from the constructor):
        DataError: a record that does not fit the file (another block size, another block count).
    """

    def __init__(self, path: str, size: int, recorded: Any, fix: str) -> None:
        self.path, self.size, self.fix = path, size, fix
        try:
            if recorded["algorithm"] != ALGORITHM:
                raise ValueError(f"algorithm {recorded['algorithm']!r}")
            self.block_bytes = int(recorded["block_bytes"])
            digits = recorded[ALGORITHM]
            blocks = -(-size // self.block_bytes) if self.block_bytes > 0 else -1
            if not isinstance(digits, str) or len(digits) != 8 * blocks:
                raise ValueError(f"{len(digits) // 8} checksums for {blocks} blocks")
            self.expected = np.array([int(digits[i : i + 8], 16) for i in range(0, len(digits), 8)], np.uint32)
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(
                f"data: the manifest's checksums of the token file '{path}' do not fit it ({err}). {fix}"
            ) from None
        self.checked = np.zeros(len(self.expected), bool)

    def check_rows(self, starts: np.ndarray, length: int, itemsize: int) -> None:
        """Check every block that holds a byte of the rows [start, start + length) (in tokens of `itemsize` bytes)
        and was not checked before in this process.

        Raises:
            DataError: a block whose bytes differ from when the file was prepared, naming the file and the block.
        """
        first = starts.astype(np.int64) * itemsize // self.block_bytes
        last = ((starts.astype(np.int64) + length) * itemsize - 1) // self.block_bytes
        if self.checked[first].all() and self.checked[last].all() and (last - first).max(initial=0) <= 1:
            return  # every block these rows touch was checked (a row spans at most two blocks)
        spans = [np.arange(a, b + 1) for a, b in zip(first, last, strict=True)]
        todo = np.unique(np.concatenate(spans)) if spans else np.array([], np.int64)
        self._check([int(i) for i in todo if not self.checked[i]])

    def check_all(self) -> None:
        """Check every block not checked yet (before the file is mapped whole)."""
        self._check([int(i) for i in np.flatnonzero(~self.checked)])

    def _check(self, blocks: list[int]) -> None:
        if not blocks:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in blocks:
                data = os.pread(fd, self.block_bytes, i * self.block_bytes)
                if zlib.crc32(data) != int(self.expected[i]):
                    start = i * self.block_bytes
                    raise DataError(
                        f"data: the token file '{self.path}' changed after it was prepared: its block {i} of "
                        f"{len(self.expected)} (bytes {start:,} to {start + len(data) - 1:,}, of "
                        f"{self.block_bytes:,} bytes each) does not match the checksum its manifest records, so the "
                        f"run would train on other tokens than those prepared. {self.fix}"
                    )
                self.checked[i] = True
        finally:
            os.close(fd)
