"""A sweep in MLflow (`ortflow -m ... logger=[tensorboard,mlflow]`): one parent run for the sweep, started before its
first job (its id in <sweep dir>/mlflow.json, which each job reads to become a child run) and ended after the last,
tagged with the best job and holding the sweep summary as artifacts. Running the sweep again in its dir (a resumed
Optuna study, an interrupted grid) continues the same parent. Called by ortflow.report.sweep.SweepSummary, Hydra's
callback; a store that fails here costs a warning (the jobs say the rest), never the sweep."""

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ortflow.config import MLflowConfig
from ortflow.files import write_json_atomic
from ortflow.report import mlflow_sink

log = logging.getLogger(__name__)


def _settings(config: DictConfig) -> MLflowConfig | None:
    node = OmegaConf.select(config, "logger.mlflow")
    if node is None or not node.get("enabled"):
        return None
    return MLflowConfig(**OmegaConf.to_container(node, resolve=True))


def _experiment(config: DictConfig, cfg: MLflowConfig) -> str:
    overrides = OmegaConf.select(config, "hydra.overrides.task", default=[]) or []
    recipe = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("recipe=")), None)
    return cfg.experiment or recipe or "ortflow"


def start_sweep(config: DictConfig, sweep_dir: Path) -> None:
    """The sweep's parent run, new or (the sweep run again in its dir) continued."""
    if (cfg := _settings(config)) is None:
        return
    try:
        found = mlflow_sink.client_for(cfg)
    except Exception as err:  # a ConfigError: each job reports it at its start, naming the key
        log.warning("logger.mlflow: the sweep has no MLflow parent run (%s)", err)
        return
    if found is None:
        return
    client, uri = found
    saved = mlflow_sink.read_saved(sweep_dir)
    try:
        if saved and saved.get("tracking_uri") == uri:
            client.update_run(saved["run_id"], status="RUNNING")
            return
        name = _experiment(config, cfg)
        experiment = mlflow_sink.experiment_id(client, uri, name)
        tags = {"sweep_dir": str(sweep_dir.resolve()), "sweeper": _sweeper(config)}
        run = client.create_run(experiment, run_name=f"sweep {sweep_dir.name}", tags=tags)
    except Exception as err:
        log.warning("MLflow tracking at %s failed (%s); the sweep's jobs are logged without a parent run", uri, err)
        return
    write_json_atomic(
        sweep_dir / mlflow_sink.RUN_ID_FILE, {"run_id": run.info.run_id, "tracking_uri": uri, "experiment": name}
    )


def _sweeper(config: DictConfig) -> str:
    target = OmegaConf.select(config, "hydra.sweeper._target_", default="") or ""
    return target.rsplit(".", 1)[-1] or "?"


def end_sweep(config: DictConfig, sweep_dir: Path, best: dict[str, Any] | None, failed: bool) -> None:
    """The best job as tags on the parent (its run id, job, objective, overrides), the summary as artifacts, the
    parent ended."""
    if (cfg := _settings(config)) is None or (saved := mlflow_sink.read_saved(sweep_dir)) is None:
        return
    try:
        found = mlflow_sink.client_for(cfg)
    except Exception:
        return
    if found is None:
        return
    client, uri = found
    parent = saved["run_id"]
    try:
        if best is not None:
            child = mlflow_sink.read_saved(sweep_dir / best["job"]) or {}
            tags = {
                "best_job": best["job"],
                "best_objective": f"{best['objective']:.6g}",
                "best_overrides": best["overrides"],
                "best_run_id": child.get("run_id", "?"),
                "objective": str(config.objective),
            }
            for key, value in tags.items():
                client.set_tag(parent, key, value)
            client.log_metric(parent, "best_objective", float(best["objective"]), int(time.time() * 1000), 0)
        for name in ("summary.csv", "summary.md", "summary.png"):
            if (sweep_dir / name).is_file():
                client.log_artifact(parent, str(sweep_dir / name))
        client.set_terminated(parent, "FAILED" if failed else "FINISHED")
    except Exception as err:
        log.warning("MLflow tracking at %s failed (%s); the sweep's parent run misses its end", uri, err)
