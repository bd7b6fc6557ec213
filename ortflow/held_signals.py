"""SIGINT and SIGTERM held back while a block runs, then delivered to the handler that was in place.

A handler that raises (Ctrl-C's KeyboardInterrupt, a run's Interrupted) can fire between any two bytecodes. Inside
the standard library's thread hand-offs that loses wake-ups: `threading.Condition.notify` interrupted after
releasing a waiter but before removing it from the list makes the next notify release the stale waiter, and the
thread that waits (TensorBoard's event-writer thread, behind `queue.Queue`) then sleeps until its timeout while
`SummaryWriter.close()` joins it. So the run's reports and its record are written with the signals held."""

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import ParamSpec, TypeVar

HELD = (signal.SIGTERM, signal.SIGINT)
P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def held() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM only wait; the first that arrived is raised again on leaving, to the handler
    that was in place before (a nested block hands it to the enclosing one). Outside the main thread, a no-op:
    Python runs signal handlers in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: pending.append(s)) for sig in HELD}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        for sig in pending[:1]:
            signal.raise_signal(sig)


def holding(function: Callable[P, R]) -> Callable[P, R]:
    """`function` runs with the signals held (see `held`)."""

    @wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with held():
            return function(*args, **kwargs)

    return call
