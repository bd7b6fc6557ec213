"""A user's callbacks, as docs/training.md shows them: importable by `_target_` from the config."""

import time
from typing import ClassVar

from ortflow.run.callbacks import Callback


class StopAt(Callback):
    """Stops the run after the first evaluation whose accuracy reaches `accuracy`; records what the loop handed it."""

    seen: ClassVar[list[tuple[str, int]]] = []  # (method, step), across instances: the test reads it after the run

    def __init__(self, accuracy: float) -> None:
        self.accuracy = accuracy

    def on_train_start(self, loop) -> None:
        StopAt.seen.append(("start", loop.state.step))

    def on_step(self, loop, step, loss) -> None:
        StopAt.seen.append(("step", step))

    def on_evaluation(self, loop, step, evaluated):
        StopAt.seen.append(("evaluation", step))
        return evaluated.get("eval/accuracy", 0.0) >= self.accuracy

    def on_best(self, loop, step) -> None:
        StopAt.seen.append(("best", step))

    def on_train_end(self, loop, metrics) -> None:
        StopAt.seen.append(("end", metrics["steps"]))


class StopOnRank(Callback):
    """Stops the run at its first evaluation, on one rank only (a metric, a file or a clock only that rank sees)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_evaluation(self, loop, step, evaluated):
        return loop.ranks.rank == self.rank


class NotACallback:
    def __init__(self) -> None:
        pass


class Paced(Callback):
    """Sleeps `seconds` after each step: a run of a few hundred steps then lasts long enough to be interrupted (its
    tracking server killed, the run itself killed) at a step the test chooses, however fast the machine."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step(self, loop, step, loss) -> None:
        time.sleep(self.seconds)
