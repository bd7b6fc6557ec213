"""The closing summary of a run, a small table built from its run.json: how it ended, its final and best metrics,
speed, what executed it (with ORT's own run counts as proof), wall time, where the results are, and, for a run
that stopped early, the command that continues it."""

import math
import shlex
from pathlib import Path
from typing import Any

from rich.table import Table

from ortflow.files import read_record
from ortflow.report.terminal import console

STATUS_STYLE = {"completed": "green", "preempted": "yellow", "interrupted": "yellow", "failed": "red"}


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _rate(value: Any) -> str:
    """samples/s, or why there is none: the first step pays for export and session creation and is never timed, so
    a run of one step (run.json's null) has no rate."""
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"{value:.4g}"
    return "n/a (only the untimed first step ran)"


def executed_text(engine: dict[str, Any]) -> str:
    """`onnxruntime (ORT ran 300/300 training steps, 8 eval batches)`, from the engine's own counters."""
    executed = engine.get("executed_by", "?")
    if "ort_train_steps" not in engine:
        return executed
    ort, torch = engine["ort_train_steps"], engine.get("torch_fallback_train_steps", 0)
    proof = f"ORT ran {ort}/{ort + torch} training steps"
    if "ort_eval_batches" in engine:
        proof += f", {engine['ort_eval_batches']} eval batches"
    return f"{executed} ({proof})"


def continue_command(record: dict[str, Any], run_dir: Path) -> str:
    overrides = [o for o in record.get("overrides", []) if not o.startswith(("trainer.resume=", "hydra.run.dir="))]
    return shlex.join(["ortflow", *overrides, "trainer.resume=auto", f"hydra.run.dir={run_dir}"])


def mlflow_text(tracked: dict[str, Any]) -> str:
    """Where the run went in MLflow, or what MLflow missed after its tracking store failed."""
    where = f"run {tracked.get('run_id')} at {tracked.get('tracking_uri')}"
    if "error" not in tracked:
        return where
    missed = tracked.get("missed", {})
    lost = f"missed {missed.get('points', 0)} points and the end of the run ({tracked['error']})"
    return f"{where}: {lost}" if tracked.get("run_id") else f"nothing sent to {tracked.get('tracking_uri')}: {lost}"


def summary_table(record: dict[str, Any], run_dir: Path, wall_s: float) -> Table:
    status = record.get("status", "?")
    metrics = record.get("metrics", {})
    table = Table(title="run summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    style = STATUS_STYLE.get(status, "")
    table.add_row("status", f"[{style}]{status}[/{style}]" if style else status)
    ended_by = record.get("ended_by")
    if ended_by not in (None, "max_steps"):
        table.add_row("ended by", f"{ended_by.replace('_', ' ')} at step {metrics.get('steps')}")
    if "train/loss" in metrics:
        table.add_row("train loss", _num(metrics["train/loss"]))
    evals = {k: v for k, v in metrics.items() if k.startswith("eval/")}
    if evals:
        table.add_row("eval", "  ".join(f"{k.removeprefix('eval/')} {_num(v)}" for k, v in evals.items()))
    best = next(((k.removeprefix("best/"), v) for k, v in metrics.items() if k.startswith("best/eval/")), None)
    if best:
        table.add_row("best eval", f"{best[0].removeprefix('eval/')} {_num(best[1])} at step {metrics['best/step']}")
    if "perf/samples_per_sec" in metrics:
        table.add_row("samples/s", _rate(metrics["perf/samples_per_sec"]))
    if "engine" in record:
        table.add_row("executed by", executed_text(record["engine"]))
    table.add_row("wall time", f"{wall_s:.1f} s")
    table.add_row("run dir", str(run_dir))
    if (run_dir / "tensorboard").is_dir():
        table.add_row("tensorboard", f"tensorboard --logdir {run_dir / 'tensorboard'}")
    if "mlflow" in record:
        table.add_row("mlflow", mlflow_text(record["mlflow"]))
    if status in ("preempted", "interrupted", "failed") and any((run_dir / "checkpoints").glob("step-*.pt")):
        table.add_row("continue with", continue_command(record, run_dir))
    return table


def print_summary(run_dir: Path, wall_s: float) -> None:
    """Print the summary of the run in `run_dir` if it started training (a run refused at start-up has only its
    error paragraph)."""
    record = read_record(run_dir)
    if not record or record.get("stage") != "training":
        return
    console().print(summary_table(record, run_dir, wall_s))
