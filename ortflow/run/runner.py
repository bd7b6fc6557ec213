"""train(cfg): validate -> seed -> build data, model, engine -> loop -> write results.

The runner never names an accel mode: the engine comes from `accel._target_` (ortflow/accel), built from one
EngineContext; the run dir (checkpoints, run.json, resume) belongs to one RunDir.
"""

import dataclasses
import logging
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ortflow import accel, allocator, distributed, machine
from ortflow.accel import catalog
from ortflow.accel.catalog import declared
from ortflow.accel.engine import Chosen, Engine, EngineContext
from ortflow.config import AUTO, FP32
from ortflow.data import Data
from ortflow.data.resumable import ResumableBatches
from ortflow.data.short_batches import ShortBatches
from ortflow.distributed import World
from ortflow.errors import ConfigError, DataError, ModelError, OrtflowError, is_allocation_failure, root_reason
from ortflow.files import as_write_failure, write_bytes_atomic
from ortflow.held_signals import held
from ortflow.model import FREEZE_KEY, OUTPUT_KEY, builder_node, select_output, sequence_first
from ortflow.model.batch_dependence import BatchDependence
from ortflow.model.contract import check_builder_result, check_model
from ortflow.model.freeze import ParameterCount, freeze
from ortflow.model.hf import check_vocabulary
from ortflow.report import mlflow_sink, terminal
from ortflow.report.logger import RunLogger
from ortflow.report.mlflow_sink import MLflowSink
from ortflow.run import callbacks, checkpoint, export, export_hf, launch, pruning
from ortflow.run.rundir import RunDir
from ortflow.run.seeding import seed_everything
from ortflow.run.signals import Interrupted, Preempted, interrupt_on_signals
from ortflow.run.trainer import Feed, Loop, LoopSettings, Ranks, fast_dev_run
from ortflow.step import deepspeed as deepspeed_steps
from ortflow.step import loss
from ortflow.step.batch import Inputs, split_batch
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


def example_batch(loader: torch.utils.data.DataLoader) -> tuple[Inputs, torch.Tensor]:
    """The first `batch_size` samples of the loader's dataset, collated as the loader would: a batch of the
    training shape that leaves the loader's shuffle generator untouched (same data order in every accel mode)."""
    dataset, size = loader.dataset, loader.batch_size
    return split_batch(loader.collate_fn([dataset[i] for i in range(min(size, len(dataset)))]))


def build_data(cfg: DictConfig) -> Data:
    """The data the config names; a builder returning something else than a Data is refused by name."""
    data = _build("data", cfg.data)
    if not isinstance(data, Data):
        raise OrtflowError(
            f"data._target_={cfg.data.get('_target_')} returned {type(data).__name__}, not an ortflow.data.Data "
            "(train and val DataLoaders yielding (inputs, targets) batches; see docs/data.md)."
        )
    _require_batches(cfg, data)
    if "vocab_size" in cfg.data and cfg.data.vocab_size is None and "vocab_size" in data.info:
        cfg.data.vocab_size = int(data.info["vocab_size"])  # the tokenizer's: model.vocab_size follows it
    return data


def _batches(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an iterable loader without a length: it is asked for batches as they come
        return None


def _require_batches(cfg: DictConfig, data: Data) -> None:
    """A split that yields no batch (data.batch_size larger than the split, with full batches only) is refused
    before the run starts, naming the sizes: training could not take a step, and an evaluation over no batch
    would report a loss of 0."""
    for split, loader in (("training", data.train), ("validation", data.val)):
        if _batches(loader) == 0:
            samples = len(loader.dataset) if hasattr(getattr(loader, "dataset", None), "__len__") else "too few"
            raise DataError(
                f"the {split} split yields no batch: it has {samples} samples and data.batch_size="
                f"{OmegaConf.select(cfg, 'data.batch_size')} (training takes full batches only). Lower data.batch_size "
                "(or give the split more data)."
            )


def _vocabulary(node: DictConfig, data: Data) -> None:
    """model.vocab_size null: the data's vocabulary (its tokenizer's); set, it must hold every token id."""
    vocab = data.info.get("vocab_size")
    if "vocab_size" not in node:
        return
    if vocab is None:
        if node.vocab_size is None:
            raise ConfigError(
                f"model.vocab_size is null, which means 'the data's vocabulary', but data "
                f"({data.info.get('source', 'this data')}) has none: it gives no token ids. Set model.vocab_size, or "
                "choose a model that fits this data (e.g. model=mlp for data=digits)."
            )
        return
    if node.vocab_size is None:
        node.vocab_size = int(vocab)
    elif node.vocab_size < int(vocab):
        raise ConfigError(
            f"model.vocab_size={node.vocab_size} is smaller than the data's vocabulary ({vocab} tokens, tokenizer "
            f"{data.info.get('tokenizer', '?')}); leave model.vocab_size null to follow the data."
        )


def build_model(cfg: DictConfig, data: Data) -> nn.Module:
    """The model the config names, checked against the model contract on one batch (the same check for every
    engine), adapted to batch-first batches when the data says the model is sequence-first."""
    return build_checked_model(cfg, data)[0]


def build_checked_model(cfg: DictConfig, data: Data) -> tuple[nn.Module, BatchDependence]:
    """build_model's model, and how it depends on the other samples of a batch (batch statistics)."""
    target = cfg.model.get("_target_", "?")
    output = cfg.model.get(OUTPUT_KEY)  # ortflow's keys, not the builder's: taken out before instantiating
    frozen = list(cfg.model.get(FREEZE_KEY) or [])
    node = builder_node(cfg.model)
    _vocabulary(node, data)
    model = check_builder_result(_build("model", node), target)
    if node.get("name_or_path"):
        check_vocabulary(model, data.info.get("vocab_size"), node.name_or_path)
    model = freeze(model, frozen)
    if cfg.get("peft") is not None:
        from ortflow.model.lora import apply_lora

        model = apply_lora(model, cfg.peft)
    if output is not None:
        model = select_output(model, str(output))
    if not data.batch_first:
        model = sequence_first(model)
    dependence = check_model(model, *example_batch(data.train), loss.build(cfg.loss), target)
    return model, dependence


def engine_context(
    cfg: DictConfig,
    model: nn.Module,
    data: Data,
    run_dir: Path,
    world: World | None = None,
    resumed_choice: dict[str, Any] | None = None,
) -> EngineContext:
    """What every engine is built from: the model, an example batch, the optim/clip/debug settings, where to write
    ONNX files, the distributed wrappers (DDP) to put outside the engine's own, and the optimizer side (DeepSpeed's
    engine under distributed=deepspeed)."""
    world = world or World()
    ctx = EngineContext(
        model=model,
        example=example_batch(data.train),
        loss=loss.build(cfg.loss),
        optim=cfg.optim,
        grad_clip=cfg.trainer.grad_clip,
        debug=cfg.debug,
        onnx_dir=run_dir / "onnx" if world.is_main else run_dir / "onnx" / f"rank-{world.rank}",
        wrap=distributed.wrapper(cfg.distributed, world),
        reduce_loss=distributed.mean_across_ranks if world.size > 1 else None,
        accumulate=cfg.trainer.accumulate_grad_batches,
        precision=cfg.trainer.precision,  # auto: resolved by the engine's build (accel.build)
        max_steps=cfg.trainer.max_steps,
        refusals=catalog.refusals(cfg),  # accel=auto rules out the candidates that cannot run this config
        resumed_choice=resumed_choice,
    )
    if "deepspeed" in cfg.distributed.wrappers and world.size > 1:  # DeepSpeed takes the module and the optimizer
        steps = deepspeed_steps.factory(cfg.distributed, ctx.batch_size, cfg.trainer.accumulate_grad_batches)
        ctx = dataclasses.replace(ctx, steps=steps)
    return ctx


def build_engine(
    cfg: DictConfig,
    model: nn.Module,
    data: Data,
    run_dir: Path,
    world: World | None = None,
    resumed_choice: dict[str, Any] | None = None,
) -> Engine:
    """The engine `accel._target_` names, around `model` (the loop never sees which one it is)."""
    return accel.build(cfg.accel, engine_context(cfg, model, data, run_dir, world, resumed_choice))


def hparams_from(overrides: list[str], cfg: DictConfig, engine: str) -> dict[str, Any]:
    """The run's command-line choices (plus accel and seed) as TensorBoard hparams."""
    params: dict[str, Any] = {"accel": engine, "seed": cfg.seed}
    for item in overrides:
        key, _, value = item.lstrip("+~").partition("=")
        if key.startswith("hydra."):
            continue
        try:
            params[key] = float(value)
        except ValueError:
            params[key] = value
    return params


def _size(params: int) -> str:
    return f"{params / 1e6:.2f}M" if params >= 1e5 else f"{params / 1e3:.1f}K"


def recipe_name(overrides: list[str]) -> str | None:
    """NAME of a `+recipe=NAME` override."""
    return next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("recipe=")), None)


def header(cfg: DictConfig, overrides: list[str], model: nn.Module, engine: Engine, run_dir: Path, start: int) -> str:
    """The run's one header line: recipe, model and size, accel mode and what executes it, steps, run dir."""
    recipe = recipe_name(overrides)
    count = ParameterCount.of(model)
    size = _size(count.total) + " parameters"
    if count.trainable != count.total:
        size += f", {_size(count.trainable)} trainable"
    target = str(cfg.model.get("_target_", type(model).__name__)).rsplit(".", 1)[-1]
    choice = engine.choice if isinstance(engine, Chosen) else None  # accel=auto's
    title = choice["title"] if choice else declared(accel.engine_module(cfg.accel), "TITLE", engine.name)
    mode = f"accel=auto -> {engine.name}" if choice and choice["by"] == "accel=auto" else f"accel={engine.name}"
    steps = f"steps {start + 1}-{cfg.trainer.max_steps}" if start else f"{cfg.trainer.max_steps} steps"
    precision = engine_precision(cfg, engine)
    parts = [f"recipe {recipe}" if recipe else None, f"{target} ({size})", f"{mode}: {title}"]
    parts.append(precision if cfg.trainer.precision != AUTO else f"{precision} (trainer.precision=auto)")
    return "ortflow  " + " | ".join(p for p in parts if p) + f" | {steps} | run dir {run_dir}"


def engine_precision(cfg: DictConfig, engine: Engine) -> str:
    """The precision the engine trains in: accel=auto's choice, else trainer.precision (auto resolved by the CPU)."""
    choice = engine.choice if isinstance(engine, Chosen) else None
    return choice["precision"] if choice else machine.resolve_precision(cfg.trainer.precision)


def _config_dict(cfg: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except Exception:  # an invalid config is still recorded, unresolved; validation reports the problem
        return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)


def _out_of_memory(cfg: DictConfig, err: BaseException) -> str:
    """One paragraph naming the settings that size the memory a step needs, with their values."""
    sizes = [
        f"{k}={OmegaConf.select(cfg, k)}" for k in ("data.batch_size", "data.block_size") if k.split(".")[1] in cfg.data
    ]
    sizes += [
        f"model.{k}={cfg.model[k]}" for k in ("d_model", "dim_feedforward", "num_layers", "hidden") if k in cfg.model
    ]
    reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return (
        f"the run ran out of memory ({reason}). The memory a step needs grows with {', '.join(sizes)}: lower "
        "data.batch_size first (then the sequence length or the model width), and run again. Nothing written "
        "before is lost."
    )


def _debug_verbose(cfg: DictConfig) -> bool:
    """debug=verbose (ORTModule's INFO/VERBOSE log level) implies logger.verbose."""
    level = OmegaConf.select(cfg, "debug.log_level")
    return getattr(level, "value", level) in ("INFO", "VERBOSE")


def load_trained(model: nn.Module, weights: dict[str, torch.Tensor], written: Path | None) -> None:
    """The trained weights into the torch model (an ORT engine's copied back), for the exports and the caller.

    Raises:
        ModelError: the model's load_state_dict refused them (its own `_load_from_state_dict`), naming the file they
            were written to first.
    """
    try:
        model.load_state_dict(weights)
    except Exception as err:
        kept = f"They are in {written}" if written else "trainer.fast_dev_run writes no final weights"
        raise ModelError(
            f"the model refused its own trained weights: its load_state_dict failed ({root_reason(err)}). {kept}, "
            "and the run's metrics in run.json. Look at the model's own code that loads a state_dict (a module's "
            "_load_from_state_dict, a load_state_dict pre-hook)."
        ) from err


@dataclass
class TrainOutcome:
    """What a finished run hands back: its final metrics (plus executed_by and run_dir), the torch model holding the
    trained weights (an ORT engine's weights copied back into it), and the data it trained on."""

    metrics: dict[str, Any]
    model: nn.Module
    data: Data


def train(
    cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None, sweep_dir: Path | None = None
) -> TrainOutcome:
    """Train as `cfg` says, writing everything under `run_dir`; return the final metrics, model and data. A job of a
    sweep gets its `sweep_dir` (logger.mlflow: its run is a child of the sweep's parent run).

    run.json records the run from its start (status "running") to its end ("completed", "failed" or
    "preempted"); a resumed run keeps the earlier attempts' records under "attempts".

    Raises:
        OrtflowError: a problem in the config, data, model or checkpoint the user can fix.
        Preempted: SIGTERM stopped the run after writing a checkpoint.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = list(overrides or [])
    _set_up_logging(cfg)
    world = distributed.world_from_env()  # every rank trains; only rank 0 writes files
    cfg = fast_dev_run(cfg)
    allocator.apply(cfg.trainer.allocator)  # before the first tensor; recorded in run.json's host
    run = RunDir(run_dir, _config_dict(cfg), overrides, cfg.seed, world)
    started = False  # whether anything stop() releases may exist (not after a refused config)
    tracker: MLflowSink | None = None
    try:
        with interrupt_on_signals():
            validate(cfg)  # the wrapper order included: before any process group starts
            user_callbacks = callbacks.from_config(cfg.callbacks)
            started = True
            world = distributed.start(cfg.distributed)
            run.open(cfg.trainer.resume, cfg.trainer.checkpoint.keep, world)
            tracker = _tracker(cfg, run, overrides, world, sweep_dir)  # before training: a bad URI stops the run here
            try:
                metrics, results, model, data = _train(cfg, run, overrides, world, user_callbacks, tracker)
            except (MemoryError, RuntimeError, OSError) as err:
                if is_allocation_failure(err):
                    raise OrtflowError(_out_of_memory(cfg, err)) from err
                # A write outside ortflow's own writers (TensorBoard, metrics.jsonl, ONNX Runtime's files).
                if (failure := as_write_failure(err, run_dir)) is not None:
                    raise failure from err
                raise
            distributed.settle()  # every rank past its last collective before any tears the group down
    except BaseException as err:
        status = {Preempted: "preempted", Interrupted: "interrupted", KeyboardInterrupt: "interrupted"}
        with held():  # run.json is never left half-updated by a second Ctrl-C
            ended = status.get(type(err), "failed")
            if tracker is not None:
                run.note(mlflow=tracker.record())
            run.finish(ended, error=f"{type(err).__name__}: {err}")
        if tracker is not None:
            tracker.end(run.path, ended, run.record)
        if isinstance(err, (Preempted, Interrupted)):
            # A clean stop (exit status 0 on preemption): its frames' locals (the engine) are of no use to a
            # traceback, and cleared they let `stop` release the engine before the process group.
            traceback.clear_frames(err.__traceback__)
        raise
    finally:
        run.release()
        if started:  # the engine's ORT sessions and DDP, then the process group: none left to shutdown
            distributed.stop()
    ended = "pruned" if results["ended_by"] == "pruned" else "completed"
    if tracker is not None:
        run.note(mlflow=tracker.record())
    run.finish(ended, metrics=metrics, **results)
    if tracker is not None:
        tracker.end(run.path, ended, run.record)
    execution = results["engine"]
    _log_done(metrics, execution["executed_by"], run_dir)
    outcome = {**metrics, "executed_by": execution["executed_by"], "precision": results["precision"]}
    return TrainOutcome({**outcome, "run_dir": str(run_dir)}, model, data)


def _set_up_logging(cfg: DictConfig) -> None:
    """The terminal's verbosity (logger.verbose, or debug=verbose), other libraries' warnings into the log, and a
    library's notice on import kept off the terminal."""
    terminal.set_verbose(bool(OmegaConf.select(cfg, "logger.verbose")) or _debug_verbose(cfg))
    logging.captureWarnings(True)  # other libraries' warnings (torch's deprecations, tracer warnings): ortflow.log
    terminal.quiet_import("torch.utils.cpp_extension")  # its import prints a CUDA_HOME notice on CPU machines


def _log_done(metrics: dict[str, Any], executed_by: str, run_dir: Path) -> None:
    """The closing line of a completed run: its train loss, eval metrics and speed, what executed it, its run dir."""
    evals = ", ".join(f"{k.replace('/', ' ')} {v:.4f}" for k, v in metrics.items() if k.startswith("eval/"))
    log.info(
        "done: train loss %.4f, %s, %.1f samples/s, executed by %s. Run dir: %s",
        metrics["train/loss"],
        evals,
        metrics["perf/samples_per_sec"],
        executed_by,
        run_dir,
    )


def _tracker(
    cfg: DictConfig, run: RunDir, overrides: list[str], world: World, sweep_dir: Path | None
) -> MLflowSink | None:
    """logger.mlflow's sink (rank 0's: the other ranks log nothing), its run started, or continued on a resume."""
    if not world.is_main:
        return None
    start = int(run.source[1]["step"]) if run.source is not None else 0
    experiment = recipe_name(overrides) or "ortflow"
    return mlflow_sink.open_sink(cfg.logger.mlflow, run.path, experiment, start, run.record, sweep_dir)


def _train(
    cfg: DictConfig,
    run: RunDir,
    overrides: list[str],
    world: World,
    user_callbacks: list[callbacks.Callback],
    tracker: MLflowSink | None = None,
) -> tuple[dict[str, Any], dict[str, Any], nn.Module, Data]:
    """The run, composed: data and model, the engine (a resumed one from its checkpoint), the logger, the loop with
    the run's callbacks and the user's, then what executed, the final weights and the exports."""
    data, model, short = _data_and_model(cfg, run, world)
    results: dict[str, Any] = {"data": data.info, "parameters": ParameterCount.of(model).as_dict()}
    train_loader, val_loader = short.wrap(data.train, data.val)
    batches = ResumableBatches(train_loader)
    built: list[float] = []

    def build(m: nn.Module) -> Engine:
        start = time.perf_counter()
        engine = build_engine(cfg, m, data, run.path, world, run.resumed_choice())
        built.append(time.perf_counter() - start)
        return engine

    engine, state = run.start(
        model,
        build,
        batches,
        cfg.trainer.max_steps,
        {"fingerprint": data.fingerprint, "tokenizer": data.tokenizer},
        cfg.trainer.allow_data_change,
    )
    precision = results["precision"] = engine_precision(cfg, engine)
    results["machine"] = machine.describe(measure_bf16=precision != FP32)
    if world.is_main and (warning := machine.emulation_warning(precision)):
        log.warning(warning)
    logger = _logger(cfg, run, overrides, (model, engine, data), state.step if state else 0, world, tracker)

    def weights() -> dict[str, torch.Tensor]:
        return checkpoint.share_tied(engine.model_state_dict(), model)

    run_callbacks = [] if cfg.trainer.fast_dev_run else [callbacks.BestWeights(lambda: run.write_best(weights()))]
    if (report := pruning.reporter(cfg.objective)) is not None:
        run_callbacks.append(callbacks.Pruning(report))
    feed = Feed(batches, val_loader, data.eval_metrics)
    ranks = Ranks(world.rank, world.size, distributed.any_rank)
    loop = Loop(engine, feed, LoopSettings.of(cfg), logger, ranks, [*run_callbacks, *user_callbacks])
    try:
        metrics = loop.run(state, save=None if cfg.trainer.fast_dev_run else run.save)
        results["ended_by"] = metrics.pop("ended_by")
        results["data"] = {**data.info, "short_batches": short.record()}
        results["engine"] = _execution(engine, world, logger, cfg.trainer.max_steps)
        if built:  # its export, artifacts and sessions where it makes them before the first step (accel=artifacts)
            metrics["perf/build_s"] = built[-1]
        logger.hparams(
            hparams_from(overrides, cfg, engine.name), {k: v for k, v in metrics.items() if isinstance(v, float)}
        )
    finally:
        logger.close()
    run.note(metrics=metrics, **results)  # recorded even if what follows fails
    final = weights()
    if not cfg.trainer.fast_dev_run:
        run.write_final(final)  # before the load below: a model that refuses them does not lose the trained weights
    load_trained(model, final, None if cfg.trainer.fast_dev_run else run.checkpoints / "final.pt")
    if world.is_main:
        results |= _exports(cfg, model, final, data, run)
    return metrics, results, model, data


def _data_and_model(cfg: DictConfig, run: RunDir, world: World) -> tuple[Data, nn.Module, ShortBatches]:
    """The data (this rank's shard), the checked model with the same initial weights on every rank, the run's data
    files written, and how short batches are handled for it."""
    seed_everything(cfg.seed)
    data = build_data(cfg)
    model, dependence = build_checked_model(cfg, data)  # the same initial weights on every rank
    if cfg.export.hf:
        export_hf.check(model, cfg.export.hf_adapter_only)
    if cfg.distributed.name != "none":  # with any number of processes, so that runs of 1 and N ranks compare
        data.train = distributed.shard(data.train, world, cfg.seed)
    if world.is_main:
        for name, content in data.run_files.items():  # the run's tokenizer and data manifest (ortflow-predict)
            write_bytes_atomic(run.path / name, content)
    return data, model, ShortBatches(dependence, data.train.batch_size)  # no padded rows with batch statistics


def _logger(
    cfg: DictConfig,
    run: RunDir,
    overrides: list[str],
    built: tuple[nn.Module, Engine, Data],
    start: int,
    world: World,
    tracker: MLflowSink | None = None,
) -> RunLogger:
    """The run's logger (TensorBoard, metrics.jsonl, the terminal, logger.csv, logger.mlflow's `tracker`), its header
    and the config and data written."""
    model, engine, data = built
    logger = RunLogger(
        run.path,
        cfg.logger,
        cfg.trainer.max_steps,
        start_step=start,
        writes=world.is_main,
        log_every=cfg.trainer.log_every,
        sinks=[tracker] if tracker is not None else [],
    )
    logger.header(header(cfg, overrides, model, engine, run.path, start))
    logger.text("config", OmegaConf.to_yaml(cfg, resolve=True))
    logger.text("data", "\n".join(f"{k}: {v}" for k, v in data.info.items()))
    return logger


def _execution(engine: Engine, world: World, logger: RunLogger, last_step: int) -> dict[str, Any]:
    """What executed the run, by the engine's own counters (on every rank of a distributed run, with whether the
    replicas ended bitwise equal), logged beside the loss."""
    execution = engine.describe()
    if world.size > 1:  # proof per rank: each one's own engine says what executed there
        execution["ranks_executed_by"] = distributed.gather(execution["executed_by"])
        execution["world_size"] = world.size
        execution["ranks_started_by"] = launch.ranks_started_by()
        digests = distributed.gather(checkpoint.digest(engine.model_state_dict()))
        execution["replicas_identical"] = len(set(digests)) == 1  # bitwise, checked at the end
    # 1 when ONNX Runtime executed every training step, 0 otherwise: plotted beside the loss.
    logger.scalars(last_step, {"engine/ort_executed": float(execution["executed_by"] == "onnxruntime")})
    logger.text("engine", "\n".join(f"{k}: {v}" for k, v in execution.items()))
    return execution


def _exports(cfg: DictConfig, model: nn.Module, final: dict[str, torch.Tensor], data: Data, run: RunDir) -> dict:
    """The exports the config asks for (export.onnx, export.hf, export.device), each checked; their records."""
    results: dict[str, Any] = {}
    if cfg.export.onnx:
        results["export"] = export.inference_onnx(model, final, data, run.path, cfg.export.opset, cfg.export.tolerance)
    if cfg.export.hf:
        inputs = split_batch(next(iter(data.val)))[0]
        adapter_only, tolerance = cfg.export.hf_adapter_only, cfg.export.tolerance
        results["export_hf"] = export_hf.save(model, data.run_files, inputs, run.path, adapter_only, tolerance)
    if cfg.export.device:
        from ortflow.device import export as device_export

        request = device_export.Request(out=run.path / "device", web=cfg.export.device_web)
        manifest = device_export.export(cfg, model, data, request, {"dir": str(run.path), "weights": "final"})
        results["export_device"] = {
            "folder": str(request.out),
            "learning_rate": manifest["learning_rate"]["value"],
            "checked_without_torch": manifest["check"]["passed"],
            "web": "web" in manifest,
        }
    return results
