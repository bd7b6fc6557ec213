"""Signals at any moment of a run. Inside the training loop SIGTERM (preemption, `kill`, a scheduler's time limit)
asks for a checkpoint after the current step and a clean stop (exit status 0). Anywhere else SIGTERM, and SIGINT
(Ctrl-C) anywhere, stop the run at once as "interrupted" (exit status 128 + signal). run.json records either."""

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)


_asked: list[int] = []  # the stop signals this process's runs were sent (SIGTERM in the loop)


def stop_was_asked() -> bool:
    """Whether a run in this process stopped on request (a checkpoint written, the command exits with 0)."""
    return bool(_asked)


class StopRequest:
    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None


class Preempted(Exception):
    """The run stopped on request after writing a checkpoint; continuing it is `trainer.resume=auto`."""

    def __init__(self, step: int, checkpoint: str, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint}")
        self.step = step
        self.checkpoint = checkpoint


# A scheduler's own preemption handler (submitit's, on SIGUSR2: it requeues the job and exits), set aside while the
# loop runs and handed the preemption once the checkpoint is written (hand_over_preemption).
_scheduler: list[Callable[[int, Any], Any]] = []


@contextmanager
def stop_on_sigterm() -> Iterator[StopRequest]:
    """While inside, SIGTERM only sets `.signal` on the yielded request (the previous handler returns after). So
    does SIGUSR2 when the process has a Python handler for it: submitit's preemption signal (SLURM jobs it runs),
    whose handler requeues the job and exits at once, mid-step; it is called after the checkpoint instead."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, _frame) -> None:
        request.signal = signum
        _asked.append(signum)
        log.warning("%s received: writing a checkpoint after this step, then stopping", signal.Signals(signum).name)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, handler)}
    usr2 = getattr(signal, "SIGUSR2", None)
    if usr2 is not None and callable(scheduler := signal.getsignal(usr2)):
        previous[usr2] = signal.signal(usr2, handler)
        _scheduler[:] = [scheduler]
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def hand_over_preemption() -> None:
    """After a run stopped on request with its checkpoint written: a scheduler that handles preemption itself
    (submitit: requeue the job, then exit) gets it now. Returns only when there is none."""
    if not _scheduler:
        return
    scheduler = _scheduler.pop()
    usr2 = signal.SIGUSR2
    signal.signal(usr2, signal.SIG_IGN)  # its own signal, if still on its way, must not requeue the job twice
    log.info("handing the preemption to the scheduler's handler (submitit: requeue the job)")
    scheduler(usr2, None)


class Interrupted(BaseException):
    """SIGTERM outside the training steps (start-up, export in engine set-up, the end) or SIGINT anywhere: the run
    stops at once, recorded as "interrupted"; the exit status is 128 + the signal number (143, 130). A
    BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int, where: str = "") -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}" + (f" during {where}" if where else ""))

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """While inside (the whole run, outside the loop's own SIGTERM handling), SIGTERM raises Interrupted and SIGINT
    raises Interrupted instead of KeyboardInterrupt, so the run's record says what happened."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    leaving = False
    late: list[int] = []  # signals that came while the previous handlers were being put back

    def handler(signum: int, _frame) -> None:
        if leaving:
            late.append(signum)
            return
        for sig in previous:  # a repeated Ctrl-C must not cut short the stop it started (the run's record)
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        # A signal landing half-way would otherwise leave a handler ignored (SIG_IGN) in the caller's process after
        # the run (a notebook that Ctrl-C no longer interrupts): it is raised again once the caller's are back.
        leaving = True
        for sig, old in previous.items():
            signal.signal(sig, old)
        for sig in late:
            signal.raise_signal(sig)
