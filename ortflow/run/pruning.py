"""The Optuna trial a sweep job belongs to (set by hydra_plugins/ortflow_optuna around each in-process job), and
the loop's hook that reports evaluations to it: a trial its pruner finds unpromising stops after that evaluation
and the run ends with status "pruned"."""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

_trial: Any = None


@contextlib.contextmanager
def active(trial: Any) -> Iterator[None]:
    global _trial
    _trial = trial
    try:
        yield
    finally:
        _trial = None


def reporter(metric: str) -> Callable[[int, dict[str, float]], bool] | None:
    """For a job inside a pruning sweep: a callback reporting `metric` at each evaluation, returning True when the
    trial should stop. None outside one (or when `metric` is not measured at evaluations)."""
    trial = _trial
    if trial is None or not metric.startswith("eval/"):
        return None

    def report(step: int, evaluated: dict[str, float]) -> bool:
        if metric not in evaluated:
            return False
        trial.report(evaluated[metric], step)
        return trial.should_prune()

    return report
