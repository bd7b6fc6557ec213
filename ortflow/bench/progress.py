"""ortflow-bench's progress: a line as each measurement starts and ends, with the bench's elapsed time and ETA (on a
terminal also a bar for the whole bench; elsewhere plain lines)."""

import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ortflow.bench.plan import Measurement
from ortflow.bench.tables import rate, short


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


class Reporter:
    """What a person watches: a line as each measurement starts and ends (setting, mode, repeat, samples/s, the
    bench's elapsed time and ETA); on a terminal also a bar for the whole bench. The ETA adds, for each measurement
    left, the mean duration of the finished ones of its mode in its setting (else of its mode, else of all); `done`
    are the measurements of earlier sessions of a resumed bench, whose durations count too."""

    def __init__(self, console: Console, todo: list[Measurement], done: list[dict[str, Any]], log: Path) -> None:
        self.console, self.todo, self.done, self.log = console, list(todo), list(done), log
        self.total = len(todo) + len(done)
        self.elapsed_before = sum(r.get("wall_s", 0.0) for r in done)
        self.started = time.monotonic()
        self.bar: Progress | None = None
        if console.is_terminal and todo:
            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[eta]}"),
                console=console,
                transient=True,
            )
            self.task = self.bar.add_task("", total=self.total, completed=len(done), eta="")
            self.bar.start()

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    def eta(self) -> float | None:
        """Seconds the measurements left should take, from the finished ones' durations (None before any)."""
        finished = [r for r in self.done if "wall_s" in r]
        if not finished:
            return None

        def estimate(m: Measurement) -> float:
            alike = [r["wall_s"] for r in finished if (r["setting"], r["mode"]) == (m.setting, m.mode)]
            alike = alike or [r["wall_s"] for r in finished if r["mode"] == m.mode]
            return statistics.mean(alike or [r["wall_s"] for r in finished])

        return sum(estimate(m) for m in self.todo)

    def start(self, m: Measurement) -> None:
        self._line(f"[{m.index}/{self.total}] {m.label()} ...")
        if self.bar:
            self.bar.update(self.task, description=m.label())

    def end(self, m: Measurement, run: dict[str, Any]) -> None:
        self.done.append(run)
        self.todo.remove(m)
        eta = self.eta() if self.todo else None
        when = f"bench {_clock(self.elapsed())}" + (f", ETA {_clock(eta)}" if eta is not None else "")
        if "error" in run:
            what = f"failed: {short(run['error'])} (see {self.log})"
        elif "ort_ops" in run:
            what = f"profiled {run['steps']} steps, {run['step_ms']:.1f} ms/step under the profilers"
        else:
            what = (
                f"{rate(run['samples_per_s'])} samples/s ({run['passes']} x {run['steps']} steps timed, "
                f"first step {run['first_step_s']:.1f} s)"
            )
        self._line(f"[{m.index}/{self.total}] {m.label()}: {what} in {run['wall_s']:.0f} s; {when}")
        if self.bar:
            self.bar.update(self.task, advance=1, eta=f"ETA {_clock(eta)}" if eta is not None else "")

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)  # above the bar while it shows

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
