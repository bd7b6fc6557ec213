"""The training loop: lr -> train step -> log -> eval, for max_steps. It talks only to an Engine."""

import itertools
import logging
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ortflow.accel.engine import Engine, EvalResult
from ortflow.config import OptimConfig, SchedulerConfig, TrainerConfig
from ortflow.errors import OrtflowError
from ortflow.logging import RunLogger
from ortflow.scheduler import lr_at

log = logging.getLogger(__name__)

# The final metrics train_loop returns (run.json "metrics"); a sweep job can return any of them as its objective.
FINAL_METRICS = ("train/loss", "eval/loss", "eval/accuracy", "perf/samples_per_sec")


def forever(loader: Iterable) -> Iterator:
    """Batches from `loader`, epoch after epoch (a DataLoader reshuffles each epoch with its generator)."""
    while True:
        yield from loader


def evaluate(engine: Engine, loader: Iterable, max_batches: int | None) -> dict[str, float]:
    """Mean loss and accuracy over (up to max_batches of) the validation split."""
    total = EvalResult(0.0, 0, 0)
    for inputs, targets in itertools.islice(loader, max_batches):
        total = total + engine.eval_step(inputs, targets)
    return {"eval/loss": total.loss_sum / total.count, "eval/accuracy": total.correct / total.count}


def train_loop(
    engine: Engine,
    train: Iterable,
    val: Iterable,
    trainer: TrainerConfig,
    optim: OptimConfig,
    scheduler: SchedulerConfig,
    logger: RunLogger,
) -> dict[str, Any]:
    """Run trainer.max_steps optimizer steps; return the final metrics.

    Raises:
        OrtflowError: the loss became NaN or infinite (the message names the step).
    """
    batches = forever(train)
    train_time = 0.0  # seconds inside train_step, excluding the first step (export, session creation)
    samples = 0
    first_step_s = 0.0
    window_loss, window_n = 0.0, 0
    metrics: dict[str, Any] = {}
    for step in range(1, trainer.max_steps + 1):
        lr = lr_at(step - 1, optim.lr, scheduler, trainer.max_steps)
        engine.set_lr(lr)
        inputs, targets = next(batches)
        start = time.perf_counter()
        loss = engine.train_step(inputs, targets)
        elapsed = time.perf_counter() - start
        if not math.isfinite(loss):
            raise OrtflowError(
                f"The training loss became {loss} at step {step}. Lower optim.lr, set trainer.grad_clip "
                "(e.g. 1.0), or check the data."
            )
        if step == 1:
            first_step_s = elapsed
        else:
            train_time += elapsed
            samples += inputs.size(0)
        window_loss, window_n = window_loss + loss, window_n + 1

        if step % trainer.log_every == 0 or step == trainer.max_steps:
            metrics["train/loss"] = window_loss / window_n
            point = {"train/loss": metrics["train/loss"], "train/lr": lr}
            if train_time > 0:
                point["perf/samples_per_sec"] = samples / train_time
            logger.scalars(step, point)
            window_loss, window_n = 0.0, 0
        if (trainer.eval_every and step % trainer.eval_every == 0) or step == trainer.max_steps:
            metrics.update(evaluate(engine, val, trainer.eval_batches))
            logger.scalars(step, {k: metrics[k] for k in ("eval/loss", "eval/accuracy")})
        logger.advance(f"loss {loss:.3f}")

    metrics["perf/samples_per_sec"] = samples / train_time if train_time > 0 else float("nan")
    metrics["perf/first_step_s"] = first_step_s
    metrics["steps"] = trainer.max_steps
    return metrics
