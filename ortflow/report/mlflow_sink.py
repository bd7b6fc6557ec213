"""logger.mlflow: the run in an MLflow tracking store, through MLflow's own client (`mlflow.tracking.MlflowClient`).

What a run sends: the resolved config flattened as params (`trainer.max_steps`, ...), the scalars RunLogger logs
(the same tags TensorBoard gets, at the same steps), tags for what executed it (engine, precision, executed_by,
ortflow and torch versions, git commit, host) and, at its end, run.json and the config as artifacts. The run id is
kept in <run dir>/mlflow.json: `trainer.resume=auto` continues the same MLflow run and sends no step twice.

The tracking store never stops training: a server that cannot be reached at the start or goes away during the run
costs one warning naming its URI; from then on nothing more is sent (TensorBoard and metrics.jsonl keep everything)
and run.json's `mlflow` record counts what MLflow missed. What the user can fix before training (the `mlflow` package
missing, a URI MLflow cannot use) is a ConfigError at the start, or a warning with `logger.mlflow.required=false`.
"""

import json
import logging
import os
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from ortflow.config import MLflowConfig
from ortflow.errors import ConfigError
from ortflow.files import json_text, write_json_atomic

log = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow.json"
DEFAULT_STORE = Path("outputs")  # under the working directory: mlflow.db and mlartifacts/
_PARAM_VALUE_MAX = 6000  # MLflow's limit on a param's value
_BATCH = 100  # MLflow's limit on params per log_batch call
# A server that went away must not hold training up: few retries, short waits (a user's own settings win).
_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}
_STATUS = {"completed": "FINISHED", "pruned": "FINISHED", "failed": "FAILED"}  # else KILLED (a resume continues it)


def default_uri() -> str:
    return f"sqlite:///{(DEFAULT_STORE / 'mlflow.db').resolve()}"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"trainer": {"max_steps": 8}} -> {"trainer.max_steps": "8"}; lists as JSON, values cut to MLflow's limit."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= flatten(value, f"{name}.")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            flat[name] = text[:_PARAM_VALUE_MAX]
    return flat


def _unusable(what: str, cfg: MLflowConfig, reason: str) -> None:
    """A problem the user fixes before training: an error, or a warning when tracking is optional."""
    if cfg.required:
        raise ConfigError(
            f"logger.mlflow: {what} ({reason}). Fix it and run again, leave MLflow out (logger=tensorboard), or set "
            "logger.mlflow.required=false to train without MLflow when it is unusable."
        )
    log.warning("logger.mlflow: %s (%s); this run trains without MLflow (logger.mlflow.required=false)", what, reason)


class MLflowSink:
    """One MLflow run fed from RunLogger's points: `scalars`, `text` (the config as an artifact) and, once run.json
    holds how the run ended, `end`. Every call to the store goes through `_send`, which turns the first failure into
    the run's one warning and counts what is not sent after it."""

    def __init__(
        self,
        client: Any,
        uri: str,
        experiment: str,
        start_step: int,
        parent: str | None = None,
        log_model: bool = False,
    ) -> None:
        self.client, self.uri, self.experiment = client, uri, experiment
        self.log_model = log_model
        self.parent = parent  # a sweep's parent run: this run is one of its children
        self.run_id: str | None = None
        self.start = start_step
        self.logged: dict[str, set[int]] = {}  # steps after `start` the store holds already (an earlier attempt's)
        self.error: str | None = None
        self.missed = {"points": 0, "calls": 0}
        self.skipped = 0  # points an earlier attempt had sent already
        self.step = start_step  # the newest step logged

    def _send(self, what: str, call: Callable[[], Any], points: int = 0) -> Any:
        if self.error is None and (self.run_id is not None or what == "start"):
            try:
                return call()
            except Exception as err:
                self.error = f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
                log.warning(
                    "MLflow tracking at %s failed (%s); training goes on without it: TensorBoard and metrics.jsonl "
                    "keep everything, run.json's `mlflow` record counts what MLflow missed.",
                    self.uri,
                    self.error,
                )
        self.missed["calls"] += 1
        self.missed["points"] += points
        return None

    def start_run(self, run_dir: Path, resume: bool, record: dict[str, Any]) -> None:
        """A new MLflow run (its id in <run dir>/mlflow.json), or, on a resume in the same store, the run the id
        names, with the steps it holds after the checkpoint's remembered so that none is sent twice."""
        saved = _read_saved(run_dir)
        if resume and saved and saved.get("tracking_uri") == self.uri:
            self._send("start", lambda: self._continue(saved["run_id"]))
        else:
            self._send("start", lambda: self._create(run_dir, record))
        if self.run_id is not None:
            write_json_atomic(
                run_dir / RUN_ID_FILE,
                {"run_id": self.run_id, "tracking_uri": self.uri, "experiment": self.experiment},
            )

    def _create(self, run_dir: Path, record: dict[str, Any]) -> None:
        from mlflow.entities import Param

        tags = start_tags(run_dir, record)
        if self.parent is not None:
            tags["mlflow.parentRunId"] = self.parent
        experiment = experiment_id(self.client, self.uri, self.experiment)
        run = self.client.create_run(experiment, run_name=run_dir.name, tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in flatten(record.get("config") or {}).items()]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])

    def _continue(self, run_id: str) -> None:
        run = self.client.get_run(run_id)
        for key in run.data.metrics:
            steps = {m.step for m in self.client.get_metric_history(run_id, key) if m.step > self.start}
            if steps:
                self.logged[key] = steps
        self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        self.step = max(self.step, step)
        fresh = {k: v for k, v in values.items() if step not in self.logged.get(k, ())}
        self.skipped += len(values) - len(fresh)
        if not fresh:
            return
        stamp = int(time.time() * 1000)
        metrics = [Metric(k, float(v), stamp, step) for k, v in fresh.items()]
        self._send("log metrics", lambda: self.client.log_batch(self.run_id, metrics=metrics), len(metrics))

    def final(self, metrics: dict[str, float]) -> None:
        """The run's final metrics as `final/<name>` at its last step, as TensorBoard's HPARAMS tab has them."""
        self.scalars(self.step, {f"final/{k}": v for k, v in metrics.items()})

    def text(self, tag: str, text: str) -> None:
        """The config as config.yaml, the data and engine descriptions as <tag>.txt artifacts."""
        name = "config.yaml" if tag == "config" else f"{tag}.txt"
        self._send(f"log {name}", lambda: self.client.log_text(self.run_id, text, name))

    def close(self) -> None:
        """Nothing to flush (each call is sent as it comes); `end` ends the run once run.json is final."""

    def record(self) -> dict[str, Any]:
        """run.json's `mlflow` record: where the run went and what the store missed."""
        out: dict[str, Any] = {"tracking_uri": self.uri, "experiment": self.experiment, "run_id": self.run_id}
        if self.skipped:
            out["points_sent_before_resume"] = self.skipped
        if self.error is not None:
            out |= {"error": self.error, "missed": dict(self.missed)}
        return out

    def end(self, run_dir: Path, status: str, record: dict[str, Any]) -> None:
        """What executed the run as tags, run.json (and with log_model the final model) as artifacts, and the run's
        MLflow status."""
        self._send("set tags", lambda: self._end_tags(record))
        final, hf = run_dir / "checkpoints" / "final.pt", run_dir / "hf"
        if self.log_model and final.is_file():
            self._send("log the model", lambda: self.client.log_artifact(self.run_id, str(final), "model"))
        if self.log_model and hf.is_dir():
            self._send("log hf/", lambda: self.client.log_artifacts(self.run_id, str(hf), "model/hf"))
        if (run_dir / "run.json").exists():
            self._send("log run.json", lambda: self.client.log_artifact(self.run_id, str(run_dir / "run.json")))
        self._send("end run", lambda: self.client.set_terminated(self.run_id, _STATUS.get(status, "KILLED")))

    def _end_tags(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        engine = record.get("engine") or {}
        tags = {
            "engine": engine.get("engine") or engine.get("accel"),
            "executed_by": engine.get("executed_by"),
            "precision": record.get("precision"),
            "status": record.get("status"),
            "pruned": "true" if record.get("status") == "pruned" else None,
        }
        tags = {k: str(v) for k, v in tags.items() if v is not None}
        # A sweep's job: the value it returns to the sweeper, as the metric `objective` at its last step.
        objective = (record.get("config") or {}).get("objective")
        value = (record.get("metrics") or {}).get(objective)
        metrics = []
        if isinstance(value, float) and self.parent is not None:
            tags["objective"] = objective
            step = int(record["metrics"].get("steps", 0))
            metrics.append(Metric("objective", value, int(time.time() * 1000), step))
        self.client.log_batch(self.run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])


def experiment_id(client: Any, uri: str, name: str) -> str:
    """The id of experiment `name`, created if missing (its artifacts beside the default local store)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = (DEFAULT_STORE / "mlartifacts").resolve().as_uri() if uri == default_uri() else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created meanwhile by another job of a sweep
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def start_tags(run_dir: Path, record: dict[str, Any]) -> dict[str, str]:
    """What is known of the run before it trains: versions, git commit, host, run dir."""
    versions = record.get("versions") or {}
    git = record.get("git") or {}
    host = record.get("host") or {}
    try:
        ortflow_version = metadata.version("ortflow")
    except metadata.PackageNotFoundError:
        ortflow_version = "unknown"
    tags = {
        "ortflow_version": ortflow_version,
        "torch_version": versions.get("torch"),
        "git_commit": git.get("commit"),
        "git_dirty": git.get("dirty"),
        "host": host.get("hostname"),
        "run_dir": str(run_dir.resolve()),
        "overrides": json_text(record.get("overrides") or []),
    }
    return {k: str(v) for k, v in tags.items() if v is not None}


def _read_saved(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / RUN_ID_FILE).read_text())
    except (OSError, ValueError):
        return None


def read_saved(folder: Path) -> dict[str, Any] | None:
    """<folder>/mlflow.json: a run dir's MLflow run, or a sweep dir's parent run."""
    return _read_saved(folder)


def client_for(cfg: MLflowConfig) -> tuple[Any, str] | None:
    """MLflow's client for logger.mlflow's store and its URI, or None (tracking optional and unusable).

    Raises:
        ConfigError: `mlflow` is not installed or the URI is one MLflow cannot use (logger.mlflow.required=true).
    """
    uri = cfg.tracking_uri or default_uri()
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as err:
        _unusable("the mlflow package is not installed", cfg, f"{err}; pip install 'ortflow[mlflow]'")
        return None
    for name, value in _HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if uri == default_uri():
        DEFAULT_STORE.mkdir(parents=True, exist_ok=True)
    try:
        client = MlflowClient(tracking_uri=uri)
    except Exception as err:  # an unknown scheme, a malformed database URI
        _unusable(f"tracking_uri={uri} is not one MLflow can use", cfg, str(err).splitlines()[0][:300])
        return None
    return client, uri


def open_sink(
    cfg: MLflowConfig,
    run_dir: Path,
    experiment: str,
    start_step: int,
    record: dict[str, Any],
    sweep_dir: Path | None = None,
) -> MLflowSink | None:
    """The run's MLflow sink, its run started (or continued: `start_step` > 0), or None without one. A sweep's job
    (`sweep_dir`) is a child of the parent run the sweep started (<sweep dir>/mlflow.json), in its experiment.

    Raises:
        ConfigError: `mlflow` is not installed or the URI is one MLflow cannot use (logger.mlflow.required=true).
    """
    if not cfg.enabled or (found := client_for(cfg)) is None:
        return None
    client, uri = found
    parent = read_saved(sweep_dir) if sweep_dir is not None else None
    if parent is not None and parent.get("tracking_uri") == uri:
        sink = MLflowSink(client, uri, parent["experiment"], start_step, parent["run_id"], cfg.log_model)
    else:
        sink = MLflowSink(client, uri, cfg.experiment or experiment, start_step, log_model=cfg.log_model)
    sink.start_run(run_dir, start_step > 0, record)
    return sink
