"""train(cfg): validate -> seed -> build data, model, engine -> loop -> write results. Nothing accel-specific
lives here beyond picking the engine builder by name."""

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ortflow.accel.engine import Engine
from ortflow.data import Data
from ortflow.errors import OrtflowError
from ortflow.logging import RunLogger, write_json_atomic
from ortflow.loop import train_loop
from ortflow.metadata import now, start_record
from ortflow.validate import validate

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and ORT's own generator (dropout inside ORT graphs)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    from onnxruntime.capi import _pybind_state

    _pybind_state.set_seed(seed)


def _build(group: str, node: DictConfig) -> Any:
    """instantiate() a builder node, turning a user's mistake into an OrtflowError naming the group."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        if isinstance(err.__cause__, OrtflowError):
            raise err.__cause__ from None
        raise OrtflowError(f"{group}._target_={node._target_}: {err}") from err


def build_engine(cfg: DictConfig, model: nn.Module, data: Data, run_dir: Path) -> Engine:
    """The engine named by accel.name, configured from its group (the loop never sees which one it is)."""
    onnx_dir = run_dir / "onnx"
    name = cfg.accel.name
    if name == "none":
        from ortflow.accel.eager import EagerEngine

        return EagerEngine.from_model(model, cfg.optim, cfg.trainer.grad_clip)
    if name == "ortmodule":
        from ortflow.accel.ortmodule import ORTModuleEngine

        return ORTModuleEngine(model, cfg.optim, cfg.trainer.grad_clip, cfg.accel, cfg.debug, onnx_dir)
    from ortflow.accel.artifacts import ArtifactsEngine

    example_inputs, _ = next(iter(data.train))
    return ArtifactsEngine(model, example_inputs, cfg.optim, cfg.trainer.grad_clip, cfg.accel, onnx_dir)


def hparams_from(overrides: list[str], cfg: DictConfig) -> dict[str, Any]:
    """The run's command-line choices (plus accel and seed) as TensorBoard hparams."""
    params: dict[str, Any] = {"accel": cfg.accel.name, "seed": cfg.seed}
    for item in overrides:
        key, _, value = item.lstrip("+~").partition("=")
        if key.startswith("hydra."):
            continue
        try:
            params[key] = float(value)
        except ValueError:
            params[key] = value
    return params


def _config_dict(cfg: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except Exception:  # an invalid config is still recorded, unresolved; validation reports the problem
        return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)


# What a run writes into its dir, besides Hydra's own .hydra/ and log file.
RUN_OUTPUTS = ("run.json", "metrics.jsonl", "tensorboard", "checkpoints", "onnx")


def set_aside_previous_attempt(run_dir: Path) -> None:
    """A sweep job re-run in its old dir (after an interrupted sweep) keeps the earlier attempt's files, moved to
    previous-attempt-N/, so that nothing is lost and the new attempt's logs do not mix with the old."""
    if not (run_dir / "run.json").exists():
        return
    n = 1 + sum(1 for _ in run_dir.glob("previous-attempt-*"))
    target = run_dir / f"previous-attempt-{n}"
    target.mkdir()
    for name in RUN_OUTPUTS:
        if (run_dir / name).exists():
            (run_dir / name).rename(target / name)
    log.info("an earlier attempt's outputs in %s were moved to %s", run_dir, target)


def train(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train as `cfg` says, writing everything under `run_dir`; return the final metrics.

    run.json records the run from its start (status "running") to its end ("completed" or "failed").

    Raises:
        OrtflowError: a problem in the config, data or model the user can fix.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    set_aside_previous_attempt(run_dir)
    overrides = list(overrides or [])
    record = start_record(_config_dict(cfg), overrides, cfg.seed)
    write_json_atomic(run_dir / "run.json", record)
    try:
        validate(cfg)
        metrics, execution, data_info = _train(cfg, run_dir, hparams_from(overrides, cfg))
    except BaseException as err:
        record |= {"status": "failed", "finished": now(), "error": f"{type(err).__name__}: {err}"}
        write_json_atomic(run_dir / "run.json", record)
        raise
    record |= {"status": "completed", "finished": now(), "engine": execution, "metrics": metrics, "data": data_info}
    write_json_atomic(run_dir / "run.json", record)
    log.info(
        "done: train loss %.4f, eval loss %.4f, eval accuracy %.4f, %.1f samples/s, executed by %s. Run dir: %s",
        metrics["train/loss"],
        metrics["eval/loss"],
        metrics["eval/accuracy"],
        metrics["perf/samples_per_sec"],
        execution["executed_by"],
        run_dir,
    )
    return {**metrics, "executed_by": execution["executed_by"], "run_dir": str(run_dir)}


def _train(cfg: DictConfig, run_dir: Path, hparams: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict]:
    seed_everything(cfg.seed)
    data: Data = _build("data", cfg.data)
    model: nn.Module = _build("model", cfg.model)
    engine = build_engine(cfg, model, data, run_dir)
    logger = RunLogger(run_dir, cfg.logger, cfg.trainer.max_steps)
    logger.text("config", OmegaConf.to_yaml(cfg, resolve=True))
    logger.text("data", "\n".join(f"{k}: {v}" for k, v in data.info.items()))
    try:
        metrics = train_loop(engine, data.train, data.val, cfg.trainer, cfg.optim, cfg.scheduler, logger)
        execution = engine.describe()
        # 1 when ONNX Runtime executed every training step, 0 otherwise: plotted beside the loss.
        ort_executed = float(execution["executed_by"] == "onnxruntime")
        logger.scalars(cfg.trainer.max_steps, {"engine/ort_executed": ort_executed})
        logger.text("engine", "\n".join(f"{k}: {v}" for k, v in execution.items()))
        logger.hparams(hparams, {k: v for k, v in metrics.items() if isinstance(v, float)})
    finally:
        logger.close()
    checkpoint = run_dir / "checkpoints" / "final.pt"
    checkpoint.parent.mkdir(exist_ok=True)
    tmp = checkpoint.with_suffix(".tmp")
    torch.save(engine.model_state_dict(), tmp)
    tmp.replace(checkpoint)
    return metrics, execution, data.info
