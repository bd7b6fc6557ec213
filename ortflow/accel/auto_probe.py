"""accel=auto's measurements (ortflow/accel/auto.py): each candidate built on a copy of the model and timed on the
run's example batch (`probe_one`), the two fastest stepped in turn (`runoff`), the random generators restored."""

import contextlib
import dataclasses
import gc
import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ortflow.accel import catalog
from ortflow.accel.auto_decision import (
    EQUAL_WITHIN,
    MIN_PAIRS,
    Probe,
    Runoff,
    median_interval,
)
from ortflow.accel.catalog import declared
from ortflow.accel.engine import EngineContext
from ortflow.errors import OrtflowError
from ortflow.model import hooks
from ortflow.step.steps import TorchSteps

WARMUP_STEPS = 2  # untimed steps after the first: the first bf16 steps were slower than the rest (oneDNN's kernels)


def settings_for(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The given (non-null) settings that engine `name` has."""
    own = {f.name for f in dataclasses.fields(catalog.engines()[name].Settings)}
    return {key: value for key, value in settings.items() if key in own and value is not None}


def rng_state() -> tuple:
    return torch.random.get_rng_state(), np.random.get_state(), random.getstate()


def set_rng_state(state: tuple) -> None:
    torch.random.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


def _step(engine: Any, ctx: EngineContext) -> float:
    inputs, targets = ctx.example
    if ctx.accumulate > 1:
        return engine.train_micro([(inputs, targets)] * ctx.accumulate)
    return engine.train_step(inputs, targets)


@contextlib.contextmanager
def _built(ctx: EngineContext, name: str, precision: str, settings: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """Engine `name` built on a copy of the model (with its parameters' hooks, which engines may refuse), its ONNX
    files in a temporary folder; released on the way out."""
    with tempfile.TemporaryDirectory(prefix=f"ortflow-auto-{name}-") as tmp:
        trial = dataclasses.replace(
            ctx,
            model=hooks.copy_model(ctx.model),
            onnx_dir=Path(tmp),
            wrap=lambda module: module,
            reduce_loss=None,
            steps=TorchSteps,  # rank 0 alone: no DeepSpeed engine, whose start is a collective
            precision=precision,
        )
        engine = None
        try:
            # a probe times an engine; its first-step check is the chosen engine's, in the run itself
            engine = catalog.engines()[name].build(trial, **settings_for(name, {**settings, "verify": False}))
            yield engine, trial
        finally:
            del engine
            gc.collect()


def _timed(engine: Any, ctx: EngineContext) -> tuple[float, float]:
    start = time.perf_counter()
    loss = _step(engine, ctx)
    return time.perf_counter() - start, loss


def _not_as_it_should(name: str, engine: Any, loss: float) -> str | None:
    """Why a candidate's steps do not count: a non-finite loss, or a record saying it did not execute as it should
    (an ORT engine whose steps PyTorch ran instead)."""
    if not math.isfinite(loss):
        return f"its loss was {loss} on the example batch"
    promised = declared(catalog.engines()[name], "EXECUTED_BY")
    said = engine.describe().get("executed_by")
    if promised is not None and said != promised:
        return f"its steps were executed by {said}, not {promised}"
    return None


def warm_up(ctx: EngineContext, name: str, precision: str, settings: dict[str, Any]) -> None:
    """One untimed step of engine `name` on a copy of the model, before any probe: what the process pays once (the
    first autograd pass, kernels' and thread pools' start-up) then lands in no probe's start-up, which
    `auto_decision.weigh` compares between engines. A failure is left to the probe to report."""
    with (
        contextlib.suppress(OrtflowError, RuntimeError, ValueError),
        _built(ctx, name, precision, settings) as (engine, trial),
    ):
        _step(engine, trial)


def probe_one(ctx: EngineContext, name: str, precision: str, settings: dict[str, Any], steps: int) -> Probe:
    """Build engine `name` on a copy of the model and time `steps` steps after an untimed first one and warm-up."""
    result = Probe(name, precision)
    try:
        start = time.perf_counter()
        with _built(ctx, name, precision, settings) as (engine, trial):
            _, loss = _timed(engine, trial)
            result.first_step_s = time.perf_counter() - start
            for _ in range(WARMUP_STEPS):  # kernels picked and memory pooled for these shapes (bf16's first steps)
                _step(engine, trial)
            times = []
            for _ in range(steps):
                seconds, loss = _timed(engine, trial)
                times.append(seconds)
            if (why := _not_as_it_should(name, engine, loss)) is not None:
                raise OrtflowError(why)
            result.step_ms = 1000 * statistics.median(times)
    except (OrtflowError, RuntimeError, ValueError) as err:
        result.error = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    return result


def runoff(ctx: EngineContext, first: Probe, second: Probe, settings: dict[str, Any]) -> Runoff:
    """Both candidates built again and stepped in turn (the order alternating) until the interval of their paired
    step-time ratio excludes 1, lies within EQUAL_WITHIN of it, or settings["budget_s"] seconds have passed."""
    result = Runoff(first.label, second.label)
    ratios: list[float] = []
    try:
        with (
            _built(ctx, first.engine, first.precision, settings) as (a, trial_a),
            _built(ctx, second.engine, second.precision, settings) as (b, trial_b),
        ):
            for engine, trial in ((a, trial_a), (b, trial_b)):
                for _ in range(1 + WARMUP_STEPS):
                    _step(engine, trial)
            start = time.perf_counter()
            while True:
                pair = [(a, trial_a), (b, trial_b)]
                timed = [_timed(e, t) for e, t in (pair if len(ratios) % 2 == 0 else pair[::-1])]
                (ta, loss_a), (tb, loss_b) = timed if len(ratios) % 2 == 0 else timed[::-1]
                ratios.append(tb / ta)
                result.seconds = time.perf_counter() - start
                if len(ratios) >= MIN_PAIRS:
                    low, high = median_interval(ratios)
                    if low > 1.0 or high < 1.0:
                        result.verdict = "separated"
                        break
                    if low >= 1 / EQUAL_WITHIN and high <= EQUAL_WITHIN:
                        break
                if result.seconds >= settings["budget_s"]:
                    break
            for name, engine, loss in ((first.engine, a, loss_a), (second.engine, b, loss_b)):
                if (why := _not_as_it_should(name, engine, loss)) is not None:
                    raise OrtflowError(f"{name}: {why}")
    except (OrtflowError, RuntimeError, ValueError) as err:
        result.error = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    if ratios:
        result.pairs, result.ratio = len(ratios), statistics.median(ratios)
        result.low, result.high = median_interval(ratios) if len(ratios) >= MIN_PAIRS else (None, None)
    return result
