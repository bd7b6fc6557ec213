"""What a run plugs into the training loop: callbacks, called at the loop's phases (ortflow/run/trainer.py: Loop).

The run's own (the best weights written to best.pt, a pruning sweep's reports) are callbacks like a user's, which
the config names under `callbacks` (each a `_target_` and its arguments, built with Hydra's instantiate):

    # my_pkg/callbacks.py                     ortflow +recipe=digits +callbacks.stop_at._target_=my_pkg.callbacks.StopAt
    from ortflow.run.callbacks import Callback  #   +callbacks.stop_at.accuracy=0.95

    class StopAt(Callback):
        def __init__(self, accuracy: float) -> None:
            self.accuracy = accuracy

        def on_evaluation(self, loop, step, evaluated):
            return evaluated.get("eval/accuracy", 0.0) >= self.accuracy   # True: stop after this step

Every method is optional and receives the loop first: `loop.state` (LoopState: the step, the counters, the metrics so
far), `loop.engine`, `loop.settings` (the trainer group, the lr schedule, the seed, the objective), `loop.ranks`
(this process's rank among the run's). A callback runs on every rank; one that writes files checks
`loop.ranks.rank == 0`. A run stopped by a callback ends as early stopping does (`ended_by` in run.json), with its
checkpoint written.
"""

import logging
from collections.abc import Callable, Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from ortflow.errors import OrtflowError

log = logging.getLogger(__name__)


class Callback:
    """The loop's extension point: override the methods you need (each does nothing here)."""

    def on_train_start(self, loop: Any) -> None:
        """Before the first step this process runs (a resumed run's too)."""

    def on_step(self, loop: Any, step: int, loss: float) -> None:
        """After each optimizer step, its logging and evaluation done, before its checkpoint."""

    def on_evaluation(self, loop: Any, step: int, evaluated: dict[str, float]) -> bool | None:
        """After each evaluation (`evaluated`: eval/loss and the loss's metrics); True stops the run after this step."""
        return None

    def on_best(self, loop: Any, step: int) -> None:
        """After an evaluation that is the best so far of the run's objective (or eval/loss)."""

    def on_train_end(self, loop: Any, metrics: dict[str, Any]) -> None:
        """After the last step, with the run's final metrics."""


class BestWeights(Callback):
    """Writes the weights of the best evaluation (best.pt) through `write`."""

    def __init__(self, write: Callable[[], None]) -> None:
        self.write = write

    def on_best(self, loop: Any, step: int) -> None:
        self.write()


class Pruning(Callback):
    """A pruning sweep's job (ortflow/run/pruning.py): reports each evaluation; the sweep's pruner may stop the run
    there (never at its last step, which ends it anyway)."""

    def __init__(self, report: Callable[[int, dict[str, float]], bool]) -> None:
        self.report = report

    def on_evaluation(self, loop: Any, step: int, evaluated: dict[str, float]) -> bool:
        if step >= loop.settings.trainer.max_steps or not self.report(step, evaluated):
            return False
        log.info("the sweep's pruner stopped this trial at step %d", step)
        loop.state.pruned_at = step
        return True


_METHODS = ("on_train_start", "on_step", "on_evaluation", "on_best", "on_train_end")


def from_config(callbacks: Mapping[str, Any]) -> list[Callback]:
    """The user's callbacks, `callbacks.<name>` each a `_target_` and its arguments, built in the config's order.

    Raises:
        OrtflowError: one cannot be built, or what it builds has none of a callback's methods; names its key.
    """
    built = []
    for name, node in callbacks.items():
        target = node.get("_target_") if isinstance(node, Mapping) else None
        if not isinstance(target, str):
            raise OrtflowError(
                f"callbacks.{name} must name a class with _target_ (e.g. +callbacks.{name}._target_=my_pkg.MyCallback, "
                "a subclass of ortflow.run.callbacks.Callback); got "
                f"{node!r}."
            )
        try:
            callback = instantiate(node, _convert_="all")
        except InstantiationException as err:
            cause = err.__cause__ or err
            raise OrtflowError(f"callbacks.{name}: {target} could not be built: {cause}") from None
        if not any(callable(getattr(callback, m, None)) for m in _METHODS):
            raise OrtflowError(
                f"callbacks.{name}: {target} built a {type(callback).__name__}, which has none of a callback's "
                f"methods ({', '.join(_METHODS)}); subclass ortflow.run.callbacks.Callback."
            )
        built.append(callback)
    return built
