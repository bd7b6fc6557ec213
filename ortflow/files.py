"""Writing files so that nothing already written is ever corrupted: every file goes to a hidden temporary name in its
own directory, is flushed and fsynced, then renamed over the final name; a failed write leaves no temporary file
behind and the previous version untouched. A write that fails because the disk is full (or read-only, or not
permitted) becomes one RunDirError naming the file and the cause, instead of the library's own message (torch's zip
writer reports a full disk as "unexpected pos ...").

JSON is written as RFC 8259 defines it: a NaN or infinite float is written as null (Python's json module would
write the invalid tokens NaN and Infinity).
"""

import contextlib
import errno
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ortflow.errors import RunDirError

# What an OSError's errno says about a write, for the message.
_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission is denied",
    errno.EPERM: "the operation is not permitted",
    errno.EFBIG: "the file is larger than this process may write",
}


def is_write_failure(err: BaseException) -> bool:
    """An OSError from the file system (full, read-only, denied), which the user can fix, not a program error."""
    return isinstance(err, OSError) and err.errno in _CAUSES


def write_failure(path: Path | str, err: OSError) -> RunDirError:
    """One paragraph naming the file that could not be written and why."""
    cause = _CAUSES.get(err.errno, "the write failed")
    return RunDirError(
        f"cannot write '{path}': {cause} ({err.strerror or err}). Nothing written before is lost: every file ortflow "
        "writes is complete or absent, and a partly written one was removed. Free some space (or choose a run dir "
        "on another disk), then continue with trainer.resume=auto."
    )


# How native libraries (ONNX Runtime, torch's writers) word a failed write in their RuntimeError messages.
_NATIVE_MESSAGES = {
    "No space left on device": errno.ENOSPC,
    "errno:28": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
}


def as_write_failure(err: BaseException, default_path: Path | str) -> RunDirError | None:
    """The RunDirError for a failed write, from an OSError or a native library's RuntimeError naming one; None when
    `err` is something else."""
    if is_write_failure(err):
        return write_failure(getattr(err, "filename", None) or default_path, err)  # type: ignore[arg-type]
    if isinstance(err, RuntimeError):
        for text, code in _NATIVE_MESSAGES.items():
            if text in str(err):
                return write_failure(default_path, OSError(code, os.strerror(code)))
    return None


class _Recording:
    """A binary file that remembers the first OSError its writes raised (a library may replace it by its own)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """`write(file)` into a temporary file beside `path`, then rename it to `path`.

    Raises:
        RunDirError: the file system refused the write (full disk, read-only, denied); nothing is left behind.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    recording = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as file:
            recording = _Recording(file)
            write(recording)  # type: ignore[arg-type]
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        cause = recording.error if recording is not None and recording.error is not None else err
        if is_write_failure(cause):
            raise write_failure(path, cause) from err  # type: ignore[arg-type]
        raise
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the rename itself made durable (not every file system allows it)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def json_safe(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (JSON null), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def json_text(value: Any, indent: int | None = None) -> str:
    """Valid JSON (RFC 8259) for `value`: non-finite floats as null, other objects by their str()."""
    return json.dumps(json_safe(value), indent=indent, default=str, allow_nan=False)


def write_json_atomic(path: Path, payload: Any) -> None:
    """`payload` as valid JSON, written atomically (see write_atomic)."""
    text = json_text(payload, indent=2).encode()
    write_atomic(path, lambda file: file.write(text))


def write_bytes_atomic(path: Path, content: bytes) -> None:
    """`content` written atomically (see write_atomic)."""
    write_atomic(path, lambda file: file.write(content))


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The run.json in `run_dir`, or None when there is none or it cannot be read."""
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat |= flatten(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
    return flat
