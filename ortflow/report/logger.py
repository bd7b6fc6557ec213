"""Where a run reports: TensorBoard scalars/text under <run dir>/tensorboard, metrics.jsonl, and the progress bar
(or plain lines) on the terminal."""

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ortflow.config import LoggerConfig
from ortflow.files import json_text
from ortflow.held_signals import holding
from ortflow.report.csv_sink import CSVSink
from ortflow.report.terminal import console

log = logging.getLogger(__name__)


def _short(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def eval_text(values: dict[str, float]) -> str:
    """`loss 1.602  accuracy 0.7222` from {"eval/loss": ..., "eval/accuracy": ...}."""
    return "  ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in values.items() if k.startswith("eval/"))


class Sink(Protocol):
    """Another place the run's points go (logger.csv's CSVSink, logger.mlflow's MLflowSink): the same scalars at the
    same steps, the texts TensorBoard gets (the config, the data, the engine)."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def text(self, tag: str, text: str) -> None: ...

    def final(self, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class RunLogger:
    """Scalars and text to TensorBoard, every log point to <run dir>/metrics.jsonl and ortflow.log, and what a person
    watches: a progress bar on a terminal (step, ETA, loss, lr, samples/s, last eval), or without one (CI, a pipe,
    a SLURM log) a plain line every `log_every` steps; evaluations print above the bar as they come. Its methods run
    with SIGINT and SIGTERM held (`ortflow/held_signals.py`): TensorBoard's writer thread must not lose a wake-up."""

    def __init__(
        self,
        run_dir: Path,
        cfg: LoggerConfig,
        total_steps: int,
        start_step: int = 0,
        writes: bool = True,
        log_every: int = 10,
        sinks: Sequence[Sink] = (),
    ) -> None:
        """`start_step`: the step a resumed run continues from. TensorBoard then drops the points an interrupted
        attempt logged after it (they are superseded); metrics.jsonl keeps every line and marks the resume.
        `writes=False` (ranks other than 0): log lines only, no files and nothing on the terminal. `sinks`: where
        else the points go (logger.csv's is made here; logger.mlflow's comes open, rank 0's only)."""
        self.points = (run_dir / "metrics.jsonl").open("a") if writes else None
        if writes and start_step:
            self.points.write(json_text({"resumed_from_step": start_step}) + "\n")
        self.writer = None
        if writes and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = start_step + 1 if start_step else None
            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        self.sinks: list[Sink] = list(sinks)
        if writes and cfg.csv:
            self.sinks.append(CSVSink(run_dir, start_step))
        self.shows = writes
        self.total, self.start, self.log_every = total_steps, start_step, log_every
        self.latest: dict[str, float] = {}  # the newest value of each scalar, for the bar and the plain lines
        self.started = time.monotonic()
        self.progress: Progress | None = None
        self.bar = writes and cfg.progress and console().is_terminal  # started by header() or the first step

    def _start_bar(self) -> None:
        self.bar = False
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console(),
        )
        self.task = self.progress.add_task("train", total=self.total, completed=self.start, status="")
        self.progress.start()

    @holding
    def header(self, text: str) -> None:
        """The run's one header line (what trains, on what, where the results go), then the bar."""
        log.info("%s", text)
        if self.shows:
            console().print(text, markup=False)
        if self.bar:
            self._start_bar()

    @holding
    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.points is not None:
            self.points.write(json_text({"step": step, **values}) + "\n")
            self.points.flush()
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
        for sink in self.sinks:
            sink.scalars(step, values)
        log.info("step %d  %s", step, "  ".join(f"{k}={v:.4g}" for k, v in values.items()))
        self.latest.update(values)
        if self.shows and any(k.startswith("eval/") for k in values):
            console().print(f"eval  step {step}/{self.total}  {eval_text(values)}", markup=False)

    def _status(self, loss: float, lr: float) -> str:
        parts = [f"loss {loss:.4f}", f"lr {_short(lr)}"]
        if "perf/samples_per_sec" in self.latest:
            parts.append(f"{self.latest['perf/samples_per_sec']:.4g} samples/s")
        if "eval/loss" in self.latest:
            parts.append(f"eval {eval_text({k: v for k, v in self.latest.items() if k.startswith('eval/')})}")
        return "  ".join(parts)

    @holding
    def advance(self, step: int, loss: float, lr: float) -> None:
        """After each step: the bar moves; without a bar, a plain line every log_every steps (and at the end)."""
        if not self.shows:
            return
        if self.bar:
            self._start_bar()
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=self._status(loss, lr))
        elif step % self.log_every == 0 or step == self.total:
            done = step - self.start
            eta = (time.monotonic() - self.started) / done * (self.total - step) if done else 0.0
            console().print(f"step {step}/{self.total}  {self._status(loss, lr)}  eta {eta:.0f}s", markup=False)

    @holding
    def text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            # TensorBoard renders text as markdown; a code block keeps YAML/JSON indentation.
            self.writer.add_text(tag, f"```\n{text}\n```", 0)
        for sink in self.sinks:
            sink.text(tag, text)

    @holding
    def hparams(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """The run's settings and final metrics for TensorBoard's HPARAMS tab (compare the jobs of a sweep)."""
        if self.writer is not None:
            self.writer.add_hparams(params, {f"final/{k}": v for k, v in metrics.items()}, run_name="hparams")
        for sink in self.sinks:
            sink.final(metrics)

    @holding
    def close(self) -> None:
        if self.points is not None:
            self.points.close()
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.writer is not None:
            self.writer.close()
        for sink in self.sinks:
            sink.close()
