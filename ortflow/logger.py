"""Where a run reports: TensorBoard scalars/text under <run dir>/tensorboard, a progress bar, run metadata."""

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ortflow.config import LoggerConfig

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON through a temporary file and rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        json.dump(payload, tmp, indent=2, default=str)
    os.replace(tmp.name, path)


class RunLogger:
    """Scalars and text to TensorBoard, every log point to <run dir>/metrics.jsonl and the Python log, and a
    progress bar."""

    def __init__(
        self, run_dir: Path, cfg: LoggerConfig, total_steps: int, start_step: int = 0, writes: bool = True
    ) -> None:
        """`start_step`: the step a resumed run continues from. TensorBoard then drops the points an interrupted
        attempt logged after it (they are superseded); metrics.jsonl keeps every line and marks the resume.
        `writes=False` (ranks other than 0): log lines only, no files and no progress bar."""
        self.points = (run_dir / "metrics.jsonl").open("a") if writes else None
        if writes and start_step:
            self.points.write(json.dumps({"resumed_from_step": start_step}) + "\n")
        self.writer = None
        if writes and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = start_step + 1 if start_step else None
            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        self.progress: Progress | None = None
        if writes and cfg.progress:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.points is not None:
            self.points.write(json.dumps({"step": step, **values}) + "\n")
            self.points.flush()
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
        log.info("step %d  %s", step, "  ".join(f"{k}={v:.4g}" for k, v in values.items()))

    def text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            # TensorBoard renders text as markdown; a code block keeps YAML/JSON indentation.
            self.writer.add_text(tag, f"```\n{text}\n```", 0)

    def hparams(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """The run's settings and final metrics for TensorBoard's HPARAMS tab (compare the jobs of a sweep)."""
        if self.writer is not None:
            self.writer.add_hparams(params, {f"final/{k}": v for k, v in metrics.items()}, run_name="hparams")

    def advance(self, status: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, status=status)

    def close(self) -> None:
        if self.points is not None:
            self.points.close()
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
