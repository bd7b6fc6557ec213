"""One benchmark measurement in its own process: `python -m ortflow.cli.bench_worker [--profile] MODE STEPS WARMUP
[OVERRIDES]`.

Prints one JSON line. A process per measurement gives each mode its own peak memory and a cold first step.
"""

import copy
import gc
import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from ortflow.accel import compat
from ortflow.accel.engine import Engine
from ortflow.config import register_configs
from ortflow.data import Data
from ortflow.data.resumable import ResumableBatches
from ortflow.paths import compose_config
from ortflow.report import profile as profiling
from ortflow.report.logger import RunLogger
from ortflow.run.runner import _build, build_data, build_engine, example_batch
from ortflow.run.seeding import seed_everything
from ortflow.run.trainer import train_loop
from ortflow.step import loss
from ortflow.step.batch import layout_of
from ortflow.step.loss import EvalResult, Loss
from ortflow.validate import validate

# torch.compile is a reference point, not an accel mode: the eager engine around a compiled model.
MODES = ("none", "ortmodule", "artifacts", "compile")


class Timed:
    """Engine proxy that adds up the time spent inside the engine's train and eval steps."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.train_s, self.eval_s = engine, 0.0, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        start = time.perf_counter()
        loss = self.engine.train_step(inputs, targets)
        self.train_s += time.perf_counter() - start
        return loss

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        start = time.perf_counter()
        result = self.engine.eval_step(inputs, targets)
        self.eval_s += time.perf_counter() - start
        return result


def model_flops(model: torch.nn.Module, data: Data, objective: Loss) -> int:
    """FLOPs of one training step (forward + backward), counted by torch on a copy of the model."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs, targets = example_batch(data.train)
    clone = copy.deepcopy(model).train()
    with FlopCounterMode(display=False) as counter:
        objective(layout_of(inputs).call(clone, layout_of(inputs).flatten(inputs)), targets).backward()
    return counter.get_total_flops()


def _start(spec: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, Any]:
    """Config, data, model and engine for mode `spec` (a mode name, optionally with its own overrides,
    `ortmodule:k=v;k2=v2`), through the first step and the warm-up steps; the rest of the batches are left to time."""
    mode, _, own = spec.partition(":")
    accel = "none" if mode == "compile" else mode
    cfg = compose_config([*overrides, f"accel={accel}", *filter(None, own.split(";")), "logger.progress=false"])
    validate(cfg)
    seed_everything(cfg.seed)
    data: Data = build_data(cfg)
    model: torch.nn.Module = _build("model", cfg.model)
    flops = model_flops(model, data, loss.build(cfg.loss))
    if mode == "compile":
        model = torch.compile(model)
    batches = list(itertools.islice(ResumableBatches(data.train), 1 + warmup + steps))
    run_dir = Path(tempfile.mkdtemp(prefix="ortflow-bench-"))
    start = time.perf_counter()  # export, session creation and compilation all land in the first step
    engine = build_engine(cfg, model, data, run_dir)
    engine.train_step(*batches[0])
    first_step_s = time.perf_counter() - start
    for x, y in batches[1 : 1 + warmup]:
        engine.train_step(x, y)
    return {
        "mode": mode,
        "cfg": cfg,
        "data": data,
        "engine": engine,
        "run_dir": run_dir,
        "timed": batches[1 + warmup :],
        "first_step_s": first_step_s,
        "flops": flops,
        "batch_size": batches[0][0].size(0),
    }


def measure(spec: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, Any]:
    """Samples/s, first step, peak memory, FLOPs and the runner's overhead of mode `spec`."""
    s = _start(spec, steps, warmup, overrides)
    mode, cfg, data, engine, run_dir, timed = s["mode"], s["cfg"], s["data"], s["engine"], s["run_dir"], s["timed"]

    # Bare hand-written loop vs ortflow's loop on the same engine, alternated in pairs; the loop's final evaluation
    # (one batch) is measured and taken out. Overhead = median over pairs of loop/bare - 1.
    bare, loop, outside = [], [], []
    trainer = OmegaConf.merge(cfg.trainer, {"max_steps": steps, "eval_every": 0, "eval_batches": 1})
    for _ in range(4):
        start = time.perf_counter()
        for x, y in timed:
            engine.train_step(x, y)
        bare.append(time.perf_counter() - start)
        proxy, logger = Timed(engine), RunLogger(run_dir, cfg.logger, steps)
        start = time.perf_counter()
        train_loop(proxy, iter(timed), data.val, trainer, cfg.optim, cfg.scheduler, logger)
        loop_s = time.perf_counter() - start - proxy.eval_s
        loop.append(loop_s)
        outside.append((loop_s - proxy.train_s) / proxy.train_s)  # the loop's own time, beside the engine's
        logger.close()
    bare_s = statistics.median(bare)
    return {
        "mode": spec,
        "executed_by": "pytorch (torch.compile)" if mode == "compile" else engine.describe()["executed_by"],
        "samples_per_s": steps * s["batch_size"] / bare_s,
        "step_ms": 1000 * bare_s / steps,
        "first_step_s": s["first_step_s"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "flops_per_step": s["flops"],
        "runner_overhead": statistics.median(lp / b for lp, b in zip(loop, bare, strict=True)) - 1.0,
        "loop_outside_engine": statistics.median(outside),
        "batch_size": s["batch_size"],
    }


def profile(spec: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, Any]:
    """Operators by time per step over `steps` steps after the warm-up: torch.profiler's list and, for the ORT
    modes, ORT's own profiler's (every session the engine creates writes a trace, read back once it has ended)."""
    ort_dir = Path(tempfile.mkdtemp(prefix="ortflow-ort-profile-"))
    os.environ[compat.ORT_PROFILE_DIR] = str(ort_dir)
    s = _start(spec, steps, warmup, overrides)
    engine, timed = s["engine"], s["timed"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for x, y in timed:
            engine.train_step(x, y)
        step_ms = 1000 * (time.perf_counter() - start) / steps
    executed_by = engine.describe()["executed_by"]
    del engine, s  # ORT writes a session's profile when the session ends
    gc.collect()
    return {
        "mode": spec,
        "executed_by": executed_by,
        "step_ms": step_ms,  # under both profilers: slower than the timed runs
        "ort_ops": profiling.ort_ops(ort_dir, skip_runs=1 + warmup, steps=steps),
        "torch_ops": profiling.torch_ops(prof, steps),
    }


def main() -> None:
    args = sys.argv[1:]
    task = profile if args[:1] == ["--profile"] else measure
    mode, steps, warmup, *overrides = args[1:] if task is profile else args
    if mode.partition(":")[0] not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, optionally followed by :overrides")
    register_configs()
    torch.manual_seed(0)
    print("ORTFLOW-BENCH " + json.dumps(task(mode, int(steps), int(warmup), overrides)), flush=True)


if __name__ == "__main__":
    main()
