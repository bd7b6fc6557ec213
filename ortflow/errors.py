"""The user-error types (config, recipe, data, model, checkpoint, run dir) and helpers.

Every problem a user can cause and fix is an `OrtflowError`, or one of its subclasses naming what it is about; the
CLI prints its message as one paragraph and exits with status 2, the Python API raises it. Internal bugs are never
wrapped in these types, so they keep their traceback: `origin` tells them apart from what a library or the user's
own code raised, by where they were raised.
"""

import sysconfig
from dataclasses import dataclass
from pathlib import Path


class OrtflowError(Exception):
    """A user-fixable problem: its message is one paragraph naming the key or file and the fix."""


class ConfigError(OrtflowError):
    """A config value, recipe or override that cannot run (the message names the key)."""


class DataError(OrtflowError):
    """A data source, data file, tokenizer or prepared token store that cannot be used (names the file)."""


class ModelError(OrtflowError):
    """A model the builder returns that breaks the model contract, or that an engine cannot train correctly."""


class CheckpointError(OrtflowError):
    """A checkpoint that cannot be read, is corrupt, or does not fit the run continuing it (names the file)."""


class TrainingDiverged(OrtflowError):
    """The loss, the gradients or an evaluation became non-finite, or the loss diverged: the run stopped before
    applying or saving that step (the message names the settings that likely caused it)."""


class RunDirError(OrtflowError):
    """A run dir that cannot be used: owned by another process, foreign, unwritable, or full."""


def collect(problems: list[str], header: str) -> None:
    """Raise one ConfigError listing every problem at once, or return if there are none."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{header}\n{lines}")


def root_reason(err: BaseException) -> str:
    """The root cause's last line: ORT embeds whole tracebacks and source locations in its exception messages."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if ": " in last else f"{type(err).__name__}: {last}"


def is_allocation_failure(err: BaseException) -> bool:
    """An out-of-memory error from Python, torch's CPU allocator or ONNX Runtime's."""
    text = str(err)
    return isinstance(err, MemoryError) or (
        isinstance(err, RuntimeError)
        and any(m in text for m in ("DefaultCPUAllocator", "can't allocate memory", "Failed to allocate memory"))
    )


@dataclass(frozen=True)
class Origin:
    """Where an exception was raised: the innermost frame of the first exception in its chain."""

    kind: str  # "ortflow" (the package, or its Hydra plugins), "library" (an installed package, the stdlib), "user"
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


_PACKAGE = Path(__file__).resolve().parent  # ortflow/
_PLUGINS = _PACKAGE.parent / "hydra_plugins"
_LIBRARIES = tuple(
    Path(p).resolve() for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _first_raised(err: BaseException) -> BaseException:
    """The deepest exception of a chain (a wrapper's cause, or what it was raised while handling)."""
    seen = {id(err)}
    while (inner := err.__cause__ or err.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        err = inner
    return err


def origin(err: BaseException) -> Origin:
    """Where `err` comes from, for telling ortflow's own bugs from what a library or the user's code raised. An
    exception a C extension raises has its caller's frame as its innermost one."""
    tb = _first_raised(err).__traceback__
    if tb is None:
        return Origin("library", "?", 0)
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    if path.is_relative_to(_PACKAGE) or (path.is_relative_to(_PLUGINS) and "ortflow" in path.parts[-2]):
        kind = "ortflow"
    elif any(path.is_relative_to(root) for root in _LIBRARIES) or not path.is_file():
        kind = "library"
    else:
        kind = "user"
    return Origin(kind, str(path), tb.tb_lineno)
