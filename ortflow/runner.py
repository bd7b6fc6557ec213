"""train(cfg): validate -> seed -> build data, model, engine -> loop -> write results. Nothing accel-specific
lives here beyond picking the engine builder by name."""

import logging
import os
import random
import sys
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


def _versions() -> dict[str, str]:
    import hydra
    import onnx
    import onnxruntime

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "hydra": hydra.__version__,
    }


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train as `cfg` says, writing everything under `run_dir`; return the final metrics.

    Raises:
        OrtflowError: a problem in the config, data or model the user can fix.
    """
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    data: Data = _build("data", cfg.data)
    model: nn.Module = _build("model", cfg.model)
    engine = build_engine(cfg, model, data, run_dir)
    logger = RunLogger(run_dir, cfg.logger, cfg.trainer.max_steps)
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    logger.text("config", resolved)
    logger.text("data", "\n".join(f"{k}: {v}" for k, v in data.info.items()))
    try:
        metrics = train_loop(engine, data.train, data.val, cfg.trainer, cfg.optim, cfg.scheduler, logger)
        execution = engine.describe()
        # 1 when ONNX Runtime executed every training step, 0 otherwise: plotted beside the loss.
        logger.scalars(cfg.trainer.max_steps, {"engine/ort_executed": float(execution["executed_by"] == "onnxruntime")})
        logger.text("engine", "\n".join(f"{k}: {v}" for k, v in execution.items()))
    finally:
        logger.close()
    checkpoint = run_dir / "checkpoints" / "final.pt"
    checkpoint.parent.mkdir(exist_ok=True)
    tmp = checkpoint.with_suffix(".tmp")
    torch.save(engine.model_state_dict(), tmp)
    tmp.replace(checkpoint)
    summary = {
        "command": sys.argv,
        "seed": cfg.seed,
        "engine": execution,
        "metrics": metrics,
        "data": data.info,
        "versions": _versions(),
        "host": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
    }
    write_json_atomic(run_dir / "run.json", summary)
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
