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
