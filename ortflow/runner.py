"""train(cfg): validate -> seed -> build data, model, engine -> loop -> write results. Nothing accel-specific
lives here beyond picking the engine builder by name."""

import logging
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ortflow import checkpoint, distributed, resume
from ortflow.accel.engine import Engine
from ortflow.data import Data
from ortflow.data.resumable import ResumableBatches
from ortflow.distributed import World
from ortflow.errors import OrtflowError
from ortflow.logging import RunLogger, write_json_atomic
from ortflow.loop import train_loop
from ortflow.metadata import now, read_record, start_record
from ortflow.resume import Checkpointer
from ortflow.rundir import set_aside_previous_attempt
from ortflow.seeding import seed_everything
from ortflow.signals import Preempted
from ortflow.validate import validate

log = logging.getLogger(__name__)


def _build(group: str, node: DictConfig) -> Any:
    """instantiate() a builder node, turning a user's mistake into an OrtflowError naming the group."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        if isinstance(err.__cause__, OrtflowError):
            raise err.__cause__ from None
        raise OrtflowError(f"{group}._target_={node._target_}: {err}") from err


def build_engine(cfg: DictConfig, model: nn.Module, data: Data, run_dir: Path, world: World | None = None) -> Engine:
    """The engine named by accel.name, configured from its group, with the distributed wrappers (DDP) outside the
    accel mode's own (the loop never sees which one it is)."""
    world = world or World()
    onnx_dir = run_dir / "onnx" if world.is_main else run_dir / "onnx" / f"rank-{world.rank}"
    name = cfg.accel.name
    wrap = distributed.wrapper(cfg.distributed, world)
    reduce = distributed.mean_across_ranks if world.size > 1 else None
    if name == "none":
        from ortflow.accel.eager import EagerEngine

        return EagerEngine.from_model(model, cfg.optim, cfg.trainer.grad_clip, wrap, reduce)
    if name == "ortmodule":
        from ortflow.accel.ortmodule import ORTModuleEngine

        return ORTModuleEngine(model, cfg.optim, cfg.trainer.grad_clip, cfg.accel, cfg.debug, onnx_dir, wrap, reduce)
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


def _history(previous: dict[str, Any]) -> list[dict[str, Any]]:
    """Earlier attempts in this run dir, oldest first, each as its status, times, error and metrics."""
    keep = ("started", "finished", "status", "error", "command", "metrics", "resumed_from")
    return [*previous.get("attempts", []), {k: previous[k] for k in keep if k in previous}]


def train(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train as `cfg` says, writing everything under `run_dir`; return the final metrics.

    run.json records the run from its start (status "running") to its end ("completed", "failed" or
    "preempted"); a resumed run keeps the earlier attempts' records under "attempts".

    Raises:
        OrtflowError: a problem in the config, data, model or checkpoint the user can fix.
        Preempted: SIGTERM stopped the run after writing a checkpoint.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = list(overrides or [])
    world = distributed.world_from_env()  # every rank trains; only rank 0 writes files
    record = start_record(_config_dict(cfg), overrides, cfg.seed)
    if previous := read_record(run_dir):
        record["attempts"] = _history(previous)
    try:
        validate(cfg)  # the wrapper order included: before any process group starts
        world = distributed.start(cfg.distributed)
        source = resume.find(cfg.trainer.resume, run_dir / "checkpoints")
        if world.is_main:
            if source is None and previous:
                set_aside_previous_attempt(run_dir)
                record.pop("attempts")  # moved along with the earlier run.json
            write_json_atomic(run_dir / "run.json", record)
        metrics, results = _train(cfg, run_dir, hparams_from(overrides, cfg), source, world)
    except BaseException as err:
        status = "preempted" if isinstance(err, Preempted) else "failed"
        record |= {"status": status, "finished": now(), "error": f"{type(err).__name__}: {err}"}
        if world.is_main:
            write_json_atomic(run_dir / "run.json", record)
        raise
    finally:
        distributed.stop()
    record |= {"status": "completed", "finished": now(), "metrics": metrics, **results}
    if world.is_main:
        write_json_atomic(run_dir / "run.json", record)
    execution = results["engine"]
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


def _train(
    cfg: DictConfig,
    run_dir: Path,
    hparams: dict[str, Any],
    source: tuple[Path, dict[str, Any]] | None,
    world: World,
) -> tuple[dict[str, Any], dict[str, Any]]:
    seed_everything(cfg.seed)
    data: Data = _build("data", cfg.data)
    model: nn.Module = _build("model", cfg.model)  # the same initial weights on every rank
    if cfg.distributed.name != "none":  # with any number of processes, so that runs of 1 and N ranks compare
        data.train = distributed.shard(data.train, world, cfg.seed)
    config = _config_dict(cfg)
    results: dict[str, Any] = {"data": data.info}
    if source is not None:
        path, payload = source
        resume.load_weights(model, payload, path, cfg.trainer.max_steps)
    engine = build_engine(cfg, model, data, run_dir, world)
    batches = ResumableBatches(data.train)
    state = None
    if source is not None:
        state, restored = resume.restore(engine, batches, payload, path)
        changes = resume.config_differences(payload["config"], config)
        if changes:
            log.warning("settings that differ from the checkpoint's: %s", "; ".join(changes))
        results["resumed_from"] = {
            "checkpoint": str(path),
            "step": state.step,
            "written_by_accel": payload["accel"],
            "optimizer_restored": restored,
            "config_changes": changes,
        }
    start = state.step if state else 0
    logger = RunLogger(run_dir, cfg.logger, cfg.trainer.max_steps, start_step=start, writes=world.is_main)
    logger.text("config", OmegaConf.to_yaml(cfg, resolve=True))
    logger.text("data", "\n".join(f"{k}: {v}" for k, v in data.info.items()))
    checkpoints = run_dir / "checkpoints"
    save = Checkpointer(checkpoints, cfg.trainer.checkpoint.keep, engine, batches, cfg.accel.name, config)
    if not world.is_main:  # the weights and optimizer state are the same on every rank; rank 0 writes them
        save = lambda state: str(checkpoint.step_path(checkpoints, state.step))  # noqa: E731
    try:
        metrics = train_loop(
            engine,
            batches,
            data.val,
            cfg.trainer,
            cfg.optim,
            cfg.scheduler,
            logger,
            state=state,
            save=save,
            seed=cfg.seed,
            rank=world.rank,
            world_size=world.size,
            any_rank=distributed.any_rank,
        )
        execution = engine.describe()
        if world.size > 1:  # proof per rank: each one's own engine says what executed there
            execution["ranks_executed_by"] = distributed.gather(execution["executed_by"])
            execution["world_size"] = world.size
            digests = distributed.gather(checkpoint.digest(engine.model_state_dict()))
            execution["replicas_identical"] = len(set(digests)) == 1  # bitwise, checked at the end
        # 1 when ONNX Runtime executed every training step, 0 otherwise: plotted beside the loss.
        ort_executed = float(execution["executed_by"] == "onnxruntime")
        logger.scalars(cfg.trainer.max_steps, {"engine/ort_executed": ort_executed})
        logger.text("engine", "\n".join(f"{k}: {v}" for k, v in execution.items()))
        logger.hparams(hparams, {k: v for k, v in metrics.items() if isinstance(v, float)})
    finally:
        logger.close()
    # The final weights alone, loadable with torch.load + model.load_state_dict (no ortflow needed).
    if world.is_main:
        checkpoint.write_atomic(engine.model_state_dict(), checkpoints / "final.pt")
    results["engine"] = execution
    return metrics, results
