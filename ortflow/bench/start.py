"""A measurement's start: config, data, model and engine of its mode, through the first step (export, session creation
and compilation land there), a fixed few warm-up steps and the choice of how many steps to time.

That choice is like timeit's autorange: steps are timed one by one until a short calibration time has passed; their
median time then decides how many steps fit in the budget.
"""

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ortflow import allocator
from ortflow.bench.flops import model_flops
from ortflow.bench.plan import mode_config
from ortflow.data import Data
from ortflow.data.resumable import ResumableBatches
from ortflow.model.freeze import ParameterCount
from ortflow.run.runner import build_data, build_engine, build_model
from ortflow.run.seeding import seed_everything
from ortflow.step import loss
from ortflow.step.batch import batch_size, split_batch
from ortflow.validate import validate

CALIBRATION_S = 1.0  # at most this long (and at most a tenth of the budget) timing single steps to choose a count
POOL = 16  # distinct batches the timed steps cycle through (fetched before any timing: memory stays bounded)


def choose_steps(
    step: Callable[[], object],
    budget_s: float,
    min_steps: int,
    passes: int,
    max_steps: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """How many steps each of `passes` timed passes gets so that they take about `budget_s` together (timeit's
    autorange, for training steps): `step` is timed one call at a time until min(CALIBRATION_S, budget_s / 10)
    has passed (at least one call); the median call decides. Never fewer than `min_steps` (nor more than
    `max_steps`, when given).

    Returns {"steps": per pass, "calibration_steps": calls made, "calibration_step_ms": the median}."""
    times: list[float] = []
    start = clock()
    while not times or clock() - start < min(CALIBRATION_S, budget_s / 10):
        before = clock()
        step()
        times.append(clock() - before)
    per_step = max(statistics.median(times), 1e-6)
    left = max(budget_s - (clock() - start), 0.0)
    steps = max(min_steps, int(left / (passes * per_step)))
    return {
        "steps": min(steps, max_steps) if max_steps else steps,
        "calibration_steps": len(times),
        "calibration_step_ms": 1000 * per_step,
    }


def start_measurement(
    args: argparse.Namespace, passes: int, scratch: Path, max_steps: int | None = None
) -> dict[str, Any]:
    """Config, data, model and engine for mode `args.mode` (a mode name, optionally with its own overrides,
    `ortmodule:k=v;k2=v2`), through the first step, the warm-up steps and the step-count calibration."""
    mode = args.mode.partition(":")[0]
    cfg = mode_config(args.mode, args.overrides)
    validate(cfg)
    allocator.apply(cfg.trainer.allocator)  # as a run of this config would train
    seed_everything(cfg.seed)
    data: Data = build_data(cfg)
    model: torch.nn.Module = build_model(cfg, data)
    flops = model_flops(model, data, loss.build(cfg.loss))
    wanted = 1 + args.warmup + min(args.steps or POOL, POOL)
    fetched = [split_batch(b) for b in itertools.islice(ResumableBatches(data.train), wanted)]
    first, warmup, pool = fetched[0], fetched[1 : 1 + args.warmup], fetched[1 + args.warmup :]
    pool = pool or fetched  # a dataset of fewer batches than the warm-up: cycle through what there is
    batches = itertools.cycle(pool)
    run_dir = scratch / "run"  # exported graphs, artifacts, the loop's logs
    run_dir.mkdir()
    start = time.perf_counter()  # export, session creation and compilation all land in the first step
    engine = build_engine(cfg, model, data, run_dir)
    engine.train_step(*first)
    first_step_s = time.perf_counter() - start
    for x, y in warmup:
        engine.train_step(x, y)
    if args.steps:
        chosen = {"steps": args.steps, "calibration_steps": 0, "calibration_step_ms": None}
    else:

        def step() -> None:
            engine.train_step(*next(batches))

        chosen = choose_steps(step, args.budget, args.min_steps, passes, max_steps)
    return {
        "mode": mode,
        "cfg": cfg,
        "data": data,
        "engine": engine,
        "run_dir": run_dir,
        "batches": batches,
        "first_step_s": first_step_s,
        "flops": flops,
        "parameters": ParameterCount.of(model).as_dict(),
        "batch_size": batch_size(first[0]),
        **chosen,
    }
