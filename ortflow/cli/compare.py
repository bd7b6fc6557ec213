"""`ortflow-compare RUN_DIR RUN_DIR [...]`: the config keys on which runs differ, their final metrics, and a PNG of
their loss and eval curves on shared axes (with the per-step loss difference when an ORT run is compared with an
eager run of the same config)."""

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ortflow.config import FINAL_METRICS
from ortflow.files import flatten
from ortflow.report.plots import plot_runs

HEAD = ("status", "executed_by", "steps")
_ABSENT = "<absent>"


def load(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "run.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"ortflow-compare: {path} does not exist; give run directories written by ortflow.") from None
    except ValueError as err:
        raise SystemExit(f"ortflow-compare: {path} is not valid JSON ({err}).") from None


def differences(configs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = sorted(set().union(*configs))
    rows = {k: [c.get(k, _ABSENT) for c in configs] for k in keys}
    return {k: values for k, values in rows.items() if len({json.dumps(v, default=str) for v in values}) > 1}


def metric_names(records: list[dict[str, Any]]) -> list[str]:
    """The rows of the metrics table: status, engine, steps, the final metrics every run reports, then the eval
    metrics any of the runs reports (eval/accuracy, eval/mae: they follow each run's loss)."""
    reported = set().union(*(r.get("metrics", {}) for r in records))
    extra = sorted(k for k in reported if k.startswith("eval/") and k not in FINAL_METRICS)
    return [*HEAD, *FINAL_METRICS, *extra]


def metric_values(record: dict[str, Any], names: list[str]) -> list[Any]:
    metrics = record.get("metrics", {})
    head = [record.get("status"), record.get("engine", {}).get("executed_by"), metrics.get("steps")]
    return head + [metrics.get(k) for k in names[len(HEAD) :]]


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ortflow-compare", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each holds a run.json)")
    parser.add_argument("--png", type=Path, help="where to write the curves (default outputs/compare/<time>.png)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two run directories")
    records = [load(r) for r in args.runs]
    names = [str(r) for r in args.runs]
    console = Console(width=None if sys.stdout.isatty() else 160)

    diff = differences([flatten(r.get("config", {})) for r in records])
    table = Table(title=f"config: {len(diff)} key(s) differ")
    table.add_column("key")
    for name in names:
        table.add_column(name)
    for key, values in diff.items():
        table.add_row(key, *(_fmt(v) for v in values))
    console.print(table)

    table = Table(title="final metrics")
    table.add_column("metric")
    for name in names:
        table.add_column(name, justify="right")
    rows = metric_names(records)
    for metric, *values in zip(rows, *(metric_values(r, rows) for r in records), strict=True):
        table.add_row(metric, *(_fmt(v) for v in values))
    console.print(table)
    png = args.png or Path("outputs") / "compare" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.png"
    console.print(f"curves: {plot_runs(args.runs, png)}")


if __name__ == "__main__":
    main()
