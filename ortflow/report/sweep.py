"""Sweep summary: after `ortflow -m ...`, one row per job at the sweep root (summary.csv, summary.md)."""

import csv
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from ortflow.files import read_record
from ortflow.report import mlflow_sweep
from ortflow.report.plots import plot_runs

log = logging.getLogger(__name__)

COLUMNS = ("job", "overrides", "status", "train/loss", "eval/loss", "samples/s", "executed_by", "error")
# The loss's own eval metrics (ortflow/step/loss.py) get a column when any job reports them.
EVAL_METRICS = ("eval/accuracy", "eval/mae")


def columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    extra = tuple(m for m in EVAL_METRICS if any(r.get(m) is not None for r in rows))
    placed = ("placement",) if any(r.get("placement") for r in rows) else ()  # jobs a launcher placed (Ray, SLURM)
    return (*COLUMNS[:3], *placed, *COLUMNS[3:5], *extra, *COLUMNS[5:])


def _placement(record: dict[str, Any]) -> str:
    """Where a launcher ran the job: `host node <id>` (Ray, its first 8 hex digits) or `host job <id>` (SLURM)."""
    where = record.get("placement")
    if not where:
        return ""
    node = f"node {where['node_id'][:8]}" if where.get("launcher") == "ray" else f"job {where.get('job_id')}"
    return f"{where.get('host', '?')} {node}"


def job_rows(sweep_dir: Path, objective: str = "eval/loss") -> list[dict[str, Any]]:
    """One row per job dir (a folder with a .hydra/ inside, or a run.json: a launcher's record of a job it could not
    start), in job order."""
    jobs = sorted(
        (p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir() or (p / "run.json").is_file()), key=_job_key
    )
    rows = []
    for job in jobs:
        record = read_record(job) or {"status": "no record (the job did not start training)"}
        metrics = record.get("metrics", {})
        rows.append(
            {
                "job": job.name,
                "overrides": " ".join(record.get("overrides", [])),
                "status": record.get("status", "?"),
                "placement": _placement(record),
                "train/loss": metrics.get("train/loss"),
                "eval/loss": metrics.get("eval/loss"),
                **{m: metrics.get(m) for m in EVAL_METRICS},
                "samples/s": metrics.get("perf/samples_per_sec"),
                "executed_by": record.get("engine", {}).get("executed_by"),
                "objective": metrics.get(objective),
                "error": record.get("error", ""),
            }
        )
    return rows


def _job_key(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (sys.maxsize, path.name)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))


def best_row(rows: list[dict[str, Any]], objective: str, maximize: bool) -> dict[str, Any] | None:
    """The completed job with the best objective (a pruned job never is: it stopped before the end)."""
    done = [r for r in rows if r["status"] == "completed" and isinstance(r.get("objective"), float)]
    if not done:
        return None
    return (max if maximize else min)(done, key=lambda r: r["objective"])


def write_summary(sweep_dir: Path, objective: str = "eval/loss", maximize: bool = False) -> list[dict[str, Any]]:
    rows = job_rows(sweep_dir, objective)
    shown = columns(rows)
    with (sweep_dir / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=shown, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in shown) + " |" for r in rows]
    if best := best_row(rows, objective, maximize):
        lines += ["", f"best: job {best['job']}, {objective} = {best['objective']:.6g} ({best['overrides']})"]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    jobs = [sweep_dir / r["job"] for r in rows if (sweep_dir / r["job"] / "metrics.jsonl").is_file()]
    if jobs:
        plot_runs(jobs, sweep_dir / "summary.png", title=f"sweep {sweep_dir}")
    return rows


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml, hydra.callbacks) run once after all jobs of a multirun (and, with
    logger.mlflow, once before them: the sweep's MLflow parent run)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        mlflow_sweep.start_sweep(config, Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        maximize = OmegaConf.select(config, "hydra.sweeper.direction", default="minimize") == "maximize"
        rows = write_summary(sweep_dir, config.objective, maximize)
        table = Table(title=f"sweep summary: {sweep_dir}")
        shown = columns(rows)[:-1]
        for column in shown:
            table.add_column(column)
        for r in rows:
            table.add_row(*(_fmt(r[c]) for c in shown))
        Console(width=None if sys.stdout.isatty() else 160).print(table)
        if best := best_row(rows, config.objective, maximize):
            log.info(
                "best: job %s, %s = %.6g (%s)", best["job"], config.objective, best["objective"], best["overrides"]
            )
        failed = [r for r in rows if r["status"] not in ("completed", "pruned")]
        mlflow_sweep.end_sweep(config, sweep_dir, best_row(rows, config.objective, maximize), bool(failed))
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
