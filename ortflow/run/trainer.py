"""The training loop (`Loop`): lr -> train step -> guard -> log -> eval -> checkpoint, up to max_steps. It talks only
to an Engine, calls the run's callbacks (ortflow/run/callbacks.py) at its phases, and keeps its counters in a
LoopState that checkpoints save and resumes restore."""

import itertools
import logging
import math
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from ortflow.accel.engine import Engine, GradNorm, MicroBatches
from ortflow.config import OnNonFinite, OptimConfig, SchedulerConfig, StopMode, TrainerConfig
from ortflow.errors import OrtflowError, TrainingDiverged
from ortflow.report.logger import RunLogger
from ortflow.run.seeding import seed_step
from ortflow.run.signals import Preempted, stop_on_sigterm
from ortflow.step.batch import batch_size, split_batch
from ortflow.step.loss import EvalResult
from ortflow.step.scheduler import lr_at

log = logging.getLogger(__name__)


@dataclass
class LoopState:
    """Everything the loop counts, so that a resumed run logs and reports as an uninterrupted one would."""

    step: int = 0  # steps done
    window_loss: float = 0.0  # sum of finite losses since the last log point
    window_n: int = 0
    train_time: float = 0.0  # seconds inside train_step, excluding each process's first step (export, sessions)
    samples: int = 0  # samples in the timed steps
    first_step_s: float = 0.0
    skipped_steps: int = 0  # non-finite steps dropped with on_nonfinite=skip
    skipped_in_a_row: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    best_value: float | None = None  # the best evaluation of the watched metric so far, and its step
    best_step: int = 0
    window_grad_norm: float = 0.0  # sum of the steps' gradient norms since the last log point
    window_grad_n: int = 0
    stop_best: float | None = None  # early stopping: the best value of its metric, evaluations since it improved
    stop_bad_evals: int = 0
    stopped_early_at: int = 0  # the step early stopping ended the run at (0: it did not)
    stopped_with_patience: int = 0
    pruned_at: int = 0  # the step a sweep's pruner stopped the run at (0: it did not)
    stopped_by_callback_at: int = 0  # the step a callback's on_evaluation stopped the run at (0: none did)
    initial_loss: float | None = None  # the first step's loss (the model as built): the divergence guard's reference


def watched_metric(objective: str) -> tuple[str, bool]:
    """The eval metric whose best value a run tracks (its objective if that is an eval metric, else eval/loss), and
    whether higher is better (accuracy)."""
    metric = objective if objective.startswith("eval/") else "eval/loss"
    return metric, metric.endswith("accuracy")


def _track_best(state: LoopState, step: int, evaluated: dict[str, float], watch: str) -> bool:
    """Record a new best evaluation of the watched metric; True if this one is it."""
    metric, higher = watched_metric(watch)
    value = evaluated.get(metric)
    if value is None or not math.isfinite(value):
        return False
    if state.best_value is None or (value > state.best_value if higher else value < state.best_value):
        state.best_value, state.best_step = value, step
        return True
    return False


# Called after a step with the state; writes a checkpoint and returns its path.
SaveCheckpoint = Callable[[LoopState], str]


def fast_dev_run(cfg: DictConfig) -> DictConfig:
    """`trainer.fast_dev_run=N` (N > 0): a smoke run of any recipe. N steps, a loss point every step, one eval batch at
    the end, no checkpoints (nor final.pt). Returns the config with those settings in place (recorded as such)."""
    steps = cfg.trainer.fast_dev_run
    if not steps:
        return cfg
    log.info("trainer.fast_dev_run=%d: %d steps, one eval batch at the end, no checkpoints", steps, steps)
    quick = {"max_steps": steps, "eval_every": 0, "eval_batches": 1, "log_every": 1, "checkpoint": {"every": 0}}
    return OmegaConf.merge(cfg, {"trainer": quick})


# Derives more eval metrics from an evaluation's (the data's: eval/bits_per_byte for text, from eval/loss).
EvalMetrics = Callable[[dict[str, float]], dict[str, float]]


def evaluate(
    engine: Engine, loader: Iterable, max_batches: int | None, derive: EvalMetrics | None = None
) -> dict[str, float]:
    """Mean loss and the loss's metrics over (up to max_batches of) the validation split, plus what `derive` adds."""
    total = EvalResult(0.0, 0)
    for batch in itertools.islice(loader, max_batches):
        total = total + engine.eval_step(*split_batch(batch))
    metrics = total.metrics()
    return metrics | derive(metrics) if derive is not None else metrics


def _likely_causes(optim: OptimConfig, lr: float, trainer: TrainerConfig) -> str:
    """The settings that most often make a loss diverge, with their values."""
    causes = [f"optim.lr={optim.lr} (this step's lr {lr:.3g})"]
    if "eps" in optim and optim.name.value == "adamw":
        causes.append(f"optim.eps={optim.eps}")
    causes.append(f"trainer.grad_clip={trainer.grad_clip}")
    return ", ".join(causes)


def _non_finite(
    loss: float, grad_norm: float | None, step: int, state: LoopState, trainer: TrainerConfig, causes: str
) -> None:
    """Stop, or count a skipped step. The engine has not applied the step's update either way."""
    state.skipped_steps += 1
    state.skipped_in_a_row += 1
    what = (
        f"The training loss became {loss}"
        if not math.isfinite(loss)
        else f"The gradients became non-finite (global norm {grad_norm}) while the loss was finite ({loss:.4g})"
    )
    if trainer.on_nonfinite == OnNonFinite.stop:
        raise TrainingDiverged(
            f"{what} at step {step}; the run stopped there, before applying that step. The checkpoints written "
            f"before it are kept. The likely causes are {causes}: lower optim.lr, raise optim.eps or set "
            "trainer.grad_clip (e.g. 1.0), or check the data, then continue with trainer.resume=auto; or set "
            "trainer.on_nonfinite=skip."
        )
    if state.skipped_in_a_row > trainer.max_skipped_steps:
        raise TrainingDiverged(
            f"The training loss or gradients were NaN/inf for {state.skipped_in_a_row} steps in a row (up to step "
            f"{step}), more than trainer.max_skipped_steps={trainer.max_skipped_steps}; the run stopped. The likely "
            f"causes are {causes}: lower optim.lr or set trainer.grad_clip."
        )
    log.warning("step %d: %s, update skipped (%d skipped so far)", step, what[4:].lower(), state.skipped_steps)


def _diverging(state: LoopState, step: int, trainer: TrainerConfig, causes: str) -> None:
    """Stop a run whose training loss, averaged over a log window, rose above trainer.divergence_factor times its
    first step's loss: the model is much worse than as it was built, the mark of a learning rate too high."""
    factor, reference = trainer.divergence_factor, state.initial_loss
    if factor is None or reference is None or not state.window_n or reference <= 0:
        return
    mean = state.window_loss / state.window_n
    if mean > factor * reference:
        raise TrainingDiverged(
            f"The training loss is diverging: its mean over the steps up to {step} is {mean:.4g}, more than "
            f"trainer.divergence_factor={factor:g} times its value at the first step ({reference:.4g}); the run "
            f"stopped there, before writing a checkpoint of it. The likely causes are {causes}: lower optim.lr "
            "(and keep warmup, scheduler.warmup_steps), or set trainer.grad_clip; trainer.divergence_factor=null "
            "turns this guard off."
        )


def _non_finite_eval(evaluated: dict[str, float], step: int, trainer: TrainerConfig) -> bool:
    """Whether an evaluation is usable; a NaN/inf eval metric stops the run (on_nonfinite=stop) or is recorded as
    missing (skip): it never becomes the best evaluation, and run.json stores it as null."""
    bad = {k: v for k, v in evaluated.items() if not math.isfinite(v)}
    if not bad:
        return False
    if trainer.on_nonfinite == OnNonFinite.stop:
        raise TrainingDiverged(
            f"The evaluation at step {step} gave {bad}: the model's outputs are no longer finite on the validation "
            "data. The run stopped before writing a checkpoint of this step; the checkpoints before it are kept. "
            "Lower optim.lr or set trainer.grad_clip, then continue with trainer.resume=auto; or set "
            "trainer.on_nonfinite=skip to go on (such evaluations are then recorded as missing)."
        )
    log.warning("step %d: evaluation gave %s; recorded as missing", step, bad)
    return True


@dataclass(frozen=True)
class LoopSettings:
    """What the loop reads of the run's config: the trainer group, the lr schedule, the seed and the objective."""

    trainer: TrainerConfig
    optim: OptimConfig
    scheduler: SchedulerConfig
    seed: int = 0  # torch's and ORT's generators are re-seeded from it, the step and the rank every step
    watch: str = "eval/loss"  # the run's objective: its best evaluation (watched_metric) and that step are tracked

    @classmethod
    def of(cls, cfg: DictConfig) -> "LoopSettings":
        return cls(cfg.trainer, cfg.optim, cfg.scheduler, cfg.seed, cfg.objective)

    def lr(self, step: int) -> float:
        return lr_at(step - 1, self.optim.lr, self.scheduler, self.trainer.max_steps)

    def causes(self, lr: float) -> str:
        return _likely_causes(self.optim, lr, self.trainer)


@dataclass(frozen=True)
class Feed:
    """The data the loop draws: endless training batches (positioned where a resumed state left off), the
    validation split, and what derives more eval metrics from an evaluation's (the data's: eval/bits_per_byte)."""

    batches: Iterator
    val: Iterable
    eval_metrics: EvalMetrics | None = None


@dataclass(frozen=True)
class Ranks:
    """This process among those training together (each with its own batch: samples/s counts all of them), and
    whether a flag is set on any of them (all ranks then stop after the same step on SIGTERM)."""

    rank: int = 0
    size: int = 1
    any_rank: Callable[[bool], bool] = bool


class Loop:
    """Optimizer steps from state.step + 1 to trainer.max_steps, in phases a reader finds by name: `_train` (lr,
    batches, seeding, the engine's step, the non-finite guard, timing), `_log`, `_evaluate` (best, early stopping,
    the callbacks' say), `_checkpoint` (cadence, SIGTERM). What a run plugs in (best weights, pruning, a user's own)
    are callbacks (ortflow/run/callbacks.py); the engine is the only thing that trains."""

    def __init__(
        self,
        engine: Engine,
        feed: Feed,
        settings: LoopSettings,
        logger: RunLogger,
        ranks: Ranks = Ranks(),
        callbacks: Sequence[Any] = (),
    ) -> None:
        self.engine, self.feed, self.settings, self.logger = engine, feed, settings, logger
        self.ranks, self.callbacks = ranks, list(callbacks)
        self.state = LoopState()

    def run(self, state: LoopState | None = None, save: SaveCheckpoint | None = None) -> dict[str, Any]:
        """Train from `state` (a fresh run: None) to the end; return the final metrics. `save` writes a checkpoint
        (every trainer.checkpoint.every steps, at the end, and on SIGTERM); None: no checkpoints.

        Raises:
            OrtflowError: the loss became NaN or infinite (the message names the step), or the engine cannot
                accumulate gradients as trainer.accumulate_grad_batches asks.
            Preempted: SIGTERM arrived; a checkpoint was written after the current step.
        """
        self.state = state or LoopState()
        trainer = self.settings.trainer
        micro = trainer.accumulate_grad_batches
        if micro > 1 and not isinstance(self.engine, MicroBatches):
            raise OrtflowError(
                f"trainer.accumulate_grad_batches={micro}: the engine {self.engine.name} cannot accumulate gradients "
                "(it has no train_micro); set trainer.accumulate_grad_batches=1 or raise data.batch_size instead."
            )
        if _already_stopped(self.state, trainer):
            return self._final()
        self._call("on_train_start")
        untimed = self.state.step + 1  # this process's first step pays for export and session creation
        with stop_on_sigterm() as stop:
            while self.state.step < trainer.max_steps:
                step = self.state.step + 1
                loss, lr = self._train(step, untimed)
                if step % trainer.log_every == 0 or step == trainer.max_steps:
                    self._log(step, lr)
                stopping = False
                if (trainer.eval_every and step % trainer.eval_every == 0) or step == trainer.max_steps:
                    stopping = self._evaluate(step)
                self.logger.advance(step, loss, lr)
                self._call("on_step", step, loss)
                if save is not None:
                    self._checkpoint(step, save, stop, last=step == trainer.max_steps or stopping)
                if stopping:
                    break
        metrics = self._final()
        self._call("on_train_end", metrics)
        return metrics

    def _train(self, step: int, untimed: int) -> tuple[float, float]:
        """One optimizer step (its micro-batches) at the scheduled lr; the loss counted, or the non-finite guard."""
        state, engine, trainer = self.state, self.engine, self.settings.trainer
        lr = self.settings.lr(step)
        engine.set_lr(lr)
        count = trainer.accumulate_grad_batches
        micro = [split_batch(next(self.feed.batches)) for _ in range(count)]
        # After the batches: a fresh loader iterator (a resumed run's first step) may draw from torch's generator.
        seed_step(self.settings.seed, step, self.ranks.rank)
        start = time.perf_counter()
        loss = engine.train_step(*micro[0]) if count == 1 else cast(MicroBatches, engine).train_micro(micro)
        elapsed = time.perf_counter() - start
        # An engine applies no update whose loss or gradient norm is not finite (Engine.train_step).
        grad_norm = engine.last_grad_norm if isinstance(engine, GradNorm) else None
        state.step = step
        if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
            state.skipped_in_a_row = 0
            state.window_loss, state.window_n = state.window_loss + loss, state.window_n + 1
            if grad_norm is not None:
                state.window_grad_norm += grad_norm
                state.window_grad_n += 1
            if state.initial_loss is None:
                state.initial_loss = loss
        else:
            _non_finite(loss, grad_norm, step, state, trainer, self.settings.causes(lr))
        if step == untimed:
            state.first_step_s = elapsed
        else:
            state.train_time += elapsed
            state.samples += sum(batch_size(inputs) for inputs, _ in micro) * self.ranks.size
        return loss, lr

    def _log(self, step: int, lr: float) -> None:
        """A log point: the means over the window since the last one; the divergence guard reads them first."""
        state = self.state
        _diverging(state, step, self.settings.trainer, self.settings.causes(lr))
        point = {"train/lr": lr}
        if state.window_n:
            state.metrics["train/loss"] = state.window_loss / state.window_n
            point["train/loss"] = state.metrics["train/loss"]
        if state.train_time > 0:
            point["perf/samples_per_sec"] = state.samples / state.train_time
        if state.window_grad_n:
            point["train/grad_norm"] = state.window_grad_norm / state.window_grad_n
        if state.skipped_steps:
            point["train/skipped_steps"] = state.skipped_steps
        self.logger.scalars(step, point)
        state.window_loss, state.window_n = 0.0, 0
        state.window_grad_norm, state.window_grad_n = 0.0, 0

    def _evaluate(self, step: int) -> bool:
        """An evaluation: recorded, the best tracked (on_best), early stopping counted; True when the run stops after
        this step (early stopping, or a callback's on_evaluation said so)."""
        trainer, state = self.settings.trainer, self.state
        evaluated = evaluate(self.engine, self.feed.val, trainer.eval_batches, self.feed.eval_metrics)
        _non_finite_eval(evaluated, step, trainer)
        state.metrics.update(evaluated)
        if _track_best(state, step, evaluated, self.settings.watch):
            self._call("on_best", step)
        self.logger.scalars(step, evaluated)
        stop = _early_stop(state, step, evaluated, trainer)
        said = any([bool(c.on_evaluation(self, step, evaluated)) for c in self._having("on_evaluation")])
        # Every rank stops at the same step or none does: a rank whose callback stopped alone would leave the others
        # waiting in DDP's next all-reduce (a SIGTERM is agreed the same way, at the checkpoint).
        said = self.ranks.any_rank(said)
        if said and not stop and state.pruned_at != step:
            state.stopped_by_callback_at = step
        return stop or said

    def _checkpoint(self, step: int, save: SaveCheckpoint, stop: Any, last: bool) -> None:
        """A checkpoint at the cadence, at the end, or when any rank got SIGTERM (then Preempted is raised)."""
        every = self.settings.trainer.checkpoint.every
        stopping = self.ranks.any_rank(stop.requested)
        if (every and step % every == 0) or last or stopping:
            path = save(self.state)
            if stopping and not last:
                raise Preempted(step, path, stop.signal or signal.SIGTERM)

    def _having(self, method: str) -> list[Any]:
        return [c for c in self.callbacks if callable(getattr(c, method, None))]

    def _call(self, method: str, *args: Any) -> None:
        for callback in self._having(method):
            getattr(callback, method)(self, *args)

    def _final(self) -> dict[str, Any]:
        return _final(self.state, self.settings.trainer, self.settings.watch)


def _already_stopped(state: LoopState, trainer: TrainerConfig) -> bool:
    """A resumed run that early stopping ended stays ended unless its limits were raised (a larger patience, or
    early stopping turned off)."""
    if not state.stopped_early_at:
        return False
    rule = trainer.early_stopping
    if rule.metric is not None and rule.patience <= state.stopped_with_patience:
        log.warning(
            "this run was stopped early at step %d (%s did not improve for %d evaluations); nothing to train. "
            "Raise trainer.early_stopping.patience or set trainer.early_stopping.metric=null to train further.",
            state.stopped_early_at,
            rule.metric,
            state.stopped_with_patience,
        )
        return True
    state.stopped_early_at = 0  # the limits were raised: go on
    return False


def _early_stop(state: LoopState, step: int, evaluated: dict[str, float], trainer: TrainerConfig) -> bool:
    """Count an evaluation against trainer.early_stopping; True when the run should stop after this step."""
    rule = trainer.early_stopping
    if rule.metric is None or rule.metric not in evaluated:
        return False
    value = evaluated[rule.metric]
    higher = rule.mode == StopMode.max
    improved = state.stop_best is None or (
        value > state.stop_best + rule.min_delta if higher else value < state.stop_best - rule.min_delta
    )
    if improved and math.isfinite(value):
        state.stop_best, state.stop_bad_evals = value, 0
        return False
    state.stop_bad_evals += 1
    if state.stop_bad_evals < rule.patience or step == trainer.max_steps:
        return False
    state.stopped_early_at, state.stopped_with_patience = step, rule.patience
    log.warning(
        "early stopping at step %d: %s has not improved by more than %g for %d evaluations (best %.4g)",
        step,
        rule.metric,
        rule.min_delta,
        rule.patience,
        state.stop_best,
    )
    return True


def _final(state: LoopState, trainer: TrainerConfig, watch: str) -> dict[str, Any]:
    if state.window_n:  # a run that stopped early, between two log points
        state.metrics["train/loss"] = state.window_loss / state.window_n
    metrics: dict[str, Any] = {"train/loss": float("nan"), **state.metrics}  # nan: every step was skipped
    metrics["perf/samples_per_sec"] = state.samples / state.train_time if state.train_time > 0 else float("nan")
    metrics["perf/first_step_s"] = state.first_step_s
    metrics["steps"] = state.step
    metrics["skipped_steps"] = state.skipped_steps
    ended = [(state.pruned_at, "pruned"), (state.stopped_early_at, "early_stopping")]
    ended.append((state.stopped_by_callback_at, "callback"))
    metrics["ended_by"] = next((how for at, how in ended if at), "max_steps")
    if state.best_value is not None:
        metrics[f"best/{watched_metric(watch)[0]}"] = state.best_value
        metrics["best/step"] = state.best_step
    return metrics
