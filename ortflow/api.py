"""The Python API: compose a config, train it, load a finished run, from a script, a notebook or a test.

It is the path the `ortflow` command takes: the same composition (pre-flight YAML checks, Hydra, the schema), the
same validation, the same run-dir claim (ortflow/run/guard.py: lock, foreign and used dirs refused) and the same
runner (ortflow/run/runner.py). What Hydra's entry point does around a job (the run dir's .hydra/ files and the
log file) is done here as well, and undone afterwards: Hydra's global state, the logging handlers, warnings
capture and signal handlers are left as they were, so `train` can run twice in one process (a Jupyter kernel
included) and never calls sys.exit. User errors raise OrtflowError subclasses (ConfigError, DataError,
ModelError, CheckpointError, RunDirError).

    import ortflow
    result = ortflow.train(["+recipe=digits", "accel=artifacts", "trainer.max_steps=50"])
    result.metrics["eval/accuracy"], result.model, result.run_dir
    again = ortflow.load_run(result.run_dir)
"""

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from ortflow import accel, preflight
from ortflow.config import store_schemas
from ortflow.errors import ConfigError
from ortflow.files import read_record
from ortflow.paths import config_dir as ortflow_config_dir
from ortflow.report.summary import print_summary
from ortflow.report.terminal import job_logging
from ortflow.validate import validate


@dataclass
class RunResult:
    """A trained (or loaded) run.

    Attributes:
        run_dir: the run's directory (run.json, checkpoints, TensorBoard, ...).
        metrics: the final metrics (train/loss, eval/loss and the loss's eval metrics, perf/samples_per_sec, steps)
            and the best evaluation (best/<metric>, best/step).
        model: the torch model with the run's weights (for an ORT engine, ORT's weights copied back), in eval mode.
        record: run.json as a dict (config, versions, what executed, status, metrics).
        config: the run's resolved config.
        tokenizer: the tokenizer the run's text data was encoded with, when it has one (None otherwise).
    """

    run_dir: Path
    metrics: dict[str, Any]
    model: nn.Module
    record: dict[str, Any]
    config: DictConfig
    tokenizer: Any = None
    weights: str = field(default="final")

    @property
    def status(self) -> str:
        return str(self.record.get("status", "?"))

    def __repr__(self) -> str:
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.metrics.items() if "/" in k}
        return f"RunResult(run_dir='{self.run_dir}', status={self.status!r}, metrics={shown})"


def register_configs() -> None:
    """Register the config schema and every built-in engine's settings with Hydra's ConfigStore (idempotent; call
    before composing)."""
    store = ConfigStore.instance()
    store_schemas(store)
    accel.register_schemas(store)


@contextlib.contextmanager
def _hydra(config_dir: str | Path | None) -> Iterator[None]:
    """ortflow's config tree initialised for composition (Hydra's global state restored on exit)."""
    register_configs()
    with initialize_config_dir(config_dir=str(ortflow_config_dir()), version_base="1.3", job_name="ortflow"):
        yield


def _search_path(config_dir: str | Path | None) -> list[str]:
    if config_dir is None:
        return []
    path = Path(config_dir).expanduser().absolute()
    if not path.is_dir():
        raise ConfigError(f"config_dir='{config_dir}' is not a directory (it holds your own config options).")
    return [f"hydra.searchpath=[file://{path}]"]


def _compose_full(overrides: Sequence[str], config_dir: str | Path | None) -> DictConfig:
    """The composed config with Hydra's node (run dir, the task's overrides), as the command line composes it."""
    overrides = [*overrides, *_search_path(config_dir)]
    preflight.check(overrides)
    try:
        with _hydra(config_dir):
            return hydra_compose("config", overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfigError(f"the overrides {list(overrides)} do not compose into a config: {text}") from None


def _task_config(full: DictConfig) -> DictConfig:
    cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])
    OmegaConf.set_struct(cfg, True)
    return cfg


def compose(overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> DictConfig:
    """The config `ortflow OVERRIDES` would train with, validated.

    Args:
        overrides: command-line style overrides, e.g. ["+recipe=transformer", "accel=artifacts"].
        config_dir: a directory of your own config options and recipes (recipe/NAME.yaml, accel/NAME.yaml, ...),
            added to the search path as `hydra.searchpath` does on the command line.

    Raises:
        ConfigError: a malformed YAML file, an override that does not compose, or values the schema refuses.
    """
    cfg = _task_config(_compose_full(overrides, config_dir))
    validate(cfg)
    return cfg


def _save_hydra_files(run_dir: Path, cfg: DictConfig, overrides: list[str]) -> None:
    """What Hydra's entry point writes into a run's .hydra/: the task's config and its overrides."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")


def train(
    cfg_or_overrides: DictConfig | Sequence[str],
    *,
    run_dir: str | Path | None = None,
    config_dir: str | Path | None = None,
) -> RunResult:
    """Train as `ortflow OVERRIDES` would, in this process; return the run's result.

    Args:
        cfg_or_overrides: command-line style overrides, or a config from `compose`.
        run_dir: where the run writes; default the `hydra.run.dir` the overrides give (outputs/<date>/<time>).
        config_dir: your own config options and recipes (see `compose`).

    Raises:
        ConfigError, DataError, ModelError, CheckpointError, RunDirError (all OrtflowError): a problem the user can
            fix, named in the message; nothing written before is lost.
        Preempted: SIGTERM stopped the run after writing a checkpoint (continue with trainer.resume=auto).
        Interrupted: SIGINT/SIGTERM outside the training steps.
    """
    from ortflow.run import launch, runner
    from ortflow.run.guard import claim

    if isinstance(cfg_or_overrides, DictConfig):
        cfg, overrides = cfg_or_overrides, []
        default_dir = Path("outputs") / f"{datetime.now():%Y-%m-%d}" / f"{datetime.now():%H-%M-%S-%f}"
    elif isinstance(cfg_or_overrides, str):
        raise ConfigError(f"ortflow.train takes a list of overrides or a config, not the string {cfg_or_overrides!r}.")
    else:
        full = _compose_full(list(cfg_or_overrides), config_dir)
        cfg, overrides = _task_config(full), list(full.hydra.overrides.task)
        default_dir = Path(full.hydra.run.dir)
    path = Path(run_dir) if run_dir is not None else default_dir
    if launch.needs_launch(cfg):
        raise ConfigError(
            f"distributed.nproc_per_node={cfg.distributed.nproc_per_node} x nnodes={cfg.distributed.nnodes} starts "
            "several processes, which the Python API does not do: run it with the `ortflow` command (or torchrun)."
        )
    lock = claim(path, OmegaConf.select(cfg, "trainer.resume"))
    started = time.monotonic()
    try:
        with job_logging(path / "ortflow.log"):
            _save_hydra_files(path, cfg, overrides)
            try:
                outcome = runner.train(cfg, path, overrides)
            finally:
                print_summary(path, time.monotonic() - started)  # as the command prints it (runs that trained)
    finally:
        lock.release()
    record = read_record(path) or {}
    return RunResult(path, outcome.metrics, outcome.model.eval(), record, cfg, outcome.data.tokenizer_object)


def load_run(run_dir: str | Path, weights: str = "final") -> RunResult:
    """A finished (or interrupted) run, from its run dir: its config, metrics, record, model with its weights, and
    the tokenizer its text data was encoded with.

    Args:
        weights: "final" (checkpoints/final.pt, the run's last weights) or "best" (checkpoints/best.pt, the best
            evaluation; final.pt when the run made no evaluation).

    Raises:
        RunDirError: the directory holds no ortflow run.
        CheckpointError: the weights file is missing or does not fit the run's model.
        ConfigError, DataError, ModelError: the run's data or model cannot be rebuilt here.
    """
    from ortflow.run import reload

    path = Path(run_dir)
    cfg, data, model, _ = reload.rebuild(path, weights)
    record = read_record(path) or {}
    return RunResult(path, dict(record.get("metrics", {})), model, record, cfg, data.tokenizer_object, weights)
