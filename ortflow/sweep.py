"""Sweep summary: after `ortflow -m ...`, one row per job at the sweep root (summary.csv, summary.md)."""

import csv
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from ortflow.metadata import read_record
from ortflow.plots import plot_runs

log = logging.getLogger(__name__)

COLUMNS = ("job", "overrides", "status", "train/loss", "eval/loss", "samples/s", "executed_by", "error")
# The loss's own eval metrics (ortflow/loss.py) get a column when any job reports them.
EVAL_METRICS = ("eval/accuracy", "eval/mae")


def columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    extra = tuple(m for m in EVAL_METRICS if any(r.get(m) is not None for r in rows))
    return (*COLUMNS[:5], *extra, *COLUMNS[5:])


def job_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job dir (a numbered folder with a .hydra/ inside), in job order."""
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()), key=_job_key)
    rows = []
    for job in jobs:
        record = read_record(job) or {"status": "no record (the job did not start training)"}
        metrics = record.get("metrics", {})
        rows.append(
            {
                "job": job.name,
                "overrides": " ".join(record.get("overrides", [])),
                "status": record.get("status", "?"),
                "train/loss": metrics.get("train/loss"),
                "eval/loss": metrics.get("eval/loss"),
                **{m: metrics.get(m) for m in EVAL_METRICS},
                "samples/s": metrics.get("perf/samples_per_sec"),
                "executed_by": record.get("engine", {}).get("executed_by"),
                "error": record.get("error", ""),
            }
        )
    return rows


def _job_key(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (sys.maxsize, path.name)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = job_rows(sweep_dir)
    shown = columns(rows)
    with (sweep_dir / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=shown, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in shown) + " |" for r in rows]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    jobs = [sweep_dir / r["job"] for r in rows if (sweep_dir / r["job"] / "metrics.jsonl").is_file()]
    if jobs:
        plot_runs(jobs, sweep_dir / "summary.png", title=f"sweep {sweep_dir}")
    return rows


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml, hydra.callbacks) run once after all jobs of a multirun."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = write_summary(sweep_dir)
        table = Table(title=f"sweep summary: {sweep_dir}")
        shown = columns(rows)[:-1]
        for column in shown:
            table.add_column(column)
        for r in rows:
            table.add_row(*(_fmt(r[c]) for c in shown))
        Console(width=None if sys.stdout.isatty() else 160).print(table)
        failed = [r for r in rows if r["status"] != "completed"]
        for r in failed:
            log.error("job %s (%s): %s %s", r["job"], r["overrides"], r["status"], r["error"])
        log.info(
            "summary: %s, curves: %s (TensorBoard HPARAMS: tensorboard --logdir %s)",
            sweep_dir / "summary.csv",
            sweep_dir / "summary.png",
            sweep_dir,
        )
        if failed:
            sys.exit(1)
