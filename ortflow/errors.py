"""The user-error types (config, recipe, data, model, checkpoint, run dir) and helpers.

Every problem a user can cause and fix is an `OrtflowError`, or one of its subclasses naming what it is about; the
CLI prints its message as one paragraph and exits with status 2, the Python API raises it. Internal bugs are never
wrapped in these types, so they keep their traceback.
"""


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
