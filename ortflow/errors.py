"""The one error type for problems a user can cause and fix (config, recipe, data, checkpoint)."""


class OrtflowError(Exception):
    """A user-fixable problem. The CLI prints its message as one paragraph and exits with status 2.

    Internal bugs are never wrapped in this type, so they keep their traceback.
    """


def collect(problems: list[str], header: str) -> None:
    """Raise one OrtflowError listing every problem at once, or return if there are none."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise OrtflowError(f"{header}\n{lines}")


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
