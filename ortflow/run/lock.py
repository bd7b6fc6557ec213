"""One owner per run dir: an advisory lock file (`<dir>/.ortflow.lock`) held for as long as a run uses the dir.

The lock is `flock` on an open file: the kernel releases it when its owner exits, however it exits (kill -9
included), so a stale lock of a dead process is taken over by the next run with nothing to clean up, and two
processes racing for one dir cannot both get it. The file holds the owner's pid, host and start time, so a refused
run can name who holds the dir. Ranks other than 0, and the processes ortflow starts itself under torchrun, do not
take it: the run they belong to already holds it.
"""

import fcntl
import json
import os
import platform
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from ortflow.errors import RunDirError

LOCK_FILE = ".ortflow.lock"


class RunDirLock:
    """The lock of one run (or sweep) dir, held from `acquire` until `release` or the end of the process."""

    def __init__(self, path: Path, fd: int, previous: bytes = b"") -> None:
        self.path = path
        self._fd: int | None = fd
        self._previous = previous  # the last owner's record, put back by release(restore=True)

    @classmethod
    def acquire(cls, directory: Path, what: str = "run dir") -> "RunDirLock":
        """Take `directory`'s lock (creating the lock file), or raise RunDirError naming the process that holds it.

        Raises:
            RunDirError: another live process holds the lock; or the lock file cannot be created.
        """
        path = directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunDirError(
                f"cannot create the lock file '{path}' of the {what} ({err.strerror}); name a {what} you can write to."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise RunDirError(
                f"the {what} '{directory}' is in use by another ortflow process ({_describe(owner)}): one process "
                f"at a time owns a {what}. Wait for that run to end (a run that is killed releases the dir at once), "
                "or use another directory."
            ) from None
        owner = {"pid": os.getpid(), "host": platform.node(), "since": datetime.now().astimezone().isoformat()}
        previous = os.pread(fd, 4096, 0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        return cls(path, fd, previous)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, restore: bool = False) -> None:
        """Give the dir up (idempotent). The lock file stays; its content only describes the last owner, or with
        `restore` (a run refused right after taking the lock) the owner before, so the dir is left as it was."""
        if self._fd is not None:
            if restore:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._previous, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def forget(self) -> None:
        """Close this process's descriptor of the lock without unlocking: in a forked child, whose parent keeps the
        lock (a flock belongs to the open file, which the parent's descriptor keeps open)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_owner(fd: int) -> dict[str, Any]:
    """The owner's record; a process that has just taken the lock writes it a moment later, so wait briefly."""
    for _ in range(20):
        try:
            owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            owner = {}
        if owner:
            return owner
        time.sleep(0.05)
    return {}


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "its pid is not recorded yet"
    since = f", since {owner['since']}" if owner.get("since") else ""
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}{since}"
