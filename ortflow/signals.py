"""SIGTERM (preemption, `kill`, a scheduler's time limit) asks the loop to checkpoint and stop after this step."""

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class StopRequest:
    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None


class Preempted(Exception):
    """The run stopped on request after writing a checkpoint; continuing it is `trainer.resume=auto`."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(f"stopped by SIGTERM after step {step}; checkpoint {checkpoint}")
        self.step = step
        self.checkpoint = checkpoint


@contextmanager
def stop_on_sigterm() -> Iterator[StopRequest]:
    """While inside, SIGTERM only sets `.signal` on the yielded request (the previous handler returns after)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, _frame) -> None:
        request.signal = signum
        log.warning("SIGTERM received: writing a checkpoint after this step, then stopping")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, previous)
