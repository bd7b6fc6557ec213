"""What a measurement process measures: samples/s, the first step, peak memory, FLOPs and the runner's overhead of a
mode; with --profile instead, its operators per step under ORT's profiler and torch.profiler."""

import argparse
import gc
import itertools
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from ortflow.accel.compat import ort
from ortflow.accel.engine import Engine, Wrapper, forwarding
from ortflow.bench.start import start_measurement
from ortflow.report import profile as profiling
from ortflow.report.logger import RunLogger
from ortflow.run.trainer import Feed, Loop, LoopSettings
from ortflow.step.loss import EvalResult

PAIRS = 2  # timed passes of a bare loop and of ortflow's loop, alternated: samples/s is the bare passes' median
PROFILE_MAX_STEPS = 50  # profiled steps at most: ORT's trace holds every node's every run


class Timed(Wrapper):
    """Engine proxy that adds up the time spent inside the engine's train and eval steps; its other capabilities are
    the engine's (`timed`)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.train_s, self.eval_s = 0.0, 0.0

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        start = time.perf_counter()
        loss = self.wrapped.train_step(inputs, targets)
        self.train_s += time.perf_counter() - start
        return loss

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> EvalResult:
        start = time.perf_counter()
        result = self.wrapped.eval_step(inputs, targets)
        self.eval_s += time.perf_counter() - start
        return result


def timed_engine(engine: Engine) -> Timed:
    """`engine` timed, offering the capabilities it offers (train_micro, last_grad_norm, ...)."""
    return forwarding(Timed, engine)(engine)


def _counters(engine: Engine) -> dict[str, Any]:
    """The engine's own account of what ran (ORT's run counters among it), JSON-safe."""
    return {k: v for k, v in engine.describe().items() if isinstance(v, str | int | float | bool)}


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Samples/s, first step, peak memory, FLOPs and the runner's overhead of mode `args.mode`."""
    s = start_measurement(args, passes=2 * PAIRS, scratch=scratch)
    cfg, data, engine, run_dir, batches = s["cfg"], s["data"], s["engine"], s["run_dir"], s["batches"]
    steps = s["steps"]

    # Bare hand-written loop vs ortflow's loop on the same engine, alternated in pairs; the loop's final evaluation
    # (one batch) is measured and taken out. Overhead = median over pairs of loop/bare - 1. Each loop starts on a
    # model already trained on the same few batches, so its first loss is no reference for the divergence guard.
    bare, loop, outside = [], [], []
    overrides = {"max_steps": steps, "eval_every": 0, "eval_batches": 1, "divergence_factor": None}
    trainer = OmegaConf.merge(cfg.trainer, overrides)
    for _ in range(PAIRS):
        timed = list(itertools.islice(batches, steps))
        start = time.perf_counter()
        for x, y in timed:
            engine.train_step(x, y)
        bare.append(time.perf_counter() - start)
        proxy, logger = timed_engine(engine), RunLogger(run_dir, cfg.logger, steps)
        start = time.perf_counter()
        Loop(proxy, Feed(iter(timed), data.val), LoopSettings(trainer, cfg.optim, cfg.scheduler), logger).run()
        loop_s = time.perf_counter() - start - proxy.eval_s
        loop.append(loop_s)
        outside.append((loop_s - proxy.train_s) / proxy.train_s)  # the loop's own time, beside the engine's
        logger.close()
    bare_s = statistics.median(bare)
    return {
        "mode": args.mode,
        "executed_by": engine.describe()["executed_by"],
        "engine": _counters(engine),
        "samples_per_s": steps * s["batch_size"] / bare_s,
        "step_ms": 1000 * bare_s / steps,
        "steps": steps,
        "passes": 2 * PAIRS,
        "warmup": args.warmup,
        "calibration_steps": s["calibration_steps"],
        "calibration_step_ms": s["calibration_step_ms"],
        "first_step_s": s["first_step_s"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "parameters": s["parameters"],
        "flops_per_step": s["flops"],
        "runner_overhead": statistics.median(lp / b for lp, b in zip(loop, bare, strict=True)) - 1.0,
        "loop_outside_engine": statistics.median(outside),
        "batch_size": s["batch_size"],
    }


def profile(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Operators by time per step over the chosen steps after the warm-up: torch.profiler's list and, for the ORT
    modes, ORT's own profiler's (every session the engine creates writes a trace, read back once it has ended)."""
    ort_dir = scratch / "ort-profiles"
    ort_dir.mkdir()
    os.environ[ort.ORT_PROFILE_DIR] = str(ort_dir)
    s = start_measurement(args, passes=1, scratch=scratch, max_steps=PROFILE_MAX_STEPS)
    engine, steps = s["engine"], s["steps"]
    timed = list(itertools.islice(s["batches"], steps))
    # record_shapes: the input dtypes and shapes that tell a dtype conversion (profiling.torch_conversions)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for x, y in timed:
            engine.train_step(x, y)
        step_ms = 1000 * (time.perf_counter() - start) / steps
    executed_by = engine.describe()["executed_by"]
    counters = _counters(engine)
    skip = 1 + args.warmup + s["calibration_steps"]  # ORT's runs before the profiled steps
    del engine, s  # ORT writes a session's profile when the session ends
    gc.collect()
    return {
        "mode": args.mode,
        "executed_by": executed_by,
        "engine": counters,
        "steps": steps,
        "step_ms": step_ms,  # under both profilers: slower than the timed runs
        "ort_ops": profiling.ort_ops(ort_dir, skip_runs=skip, steps=steps),
        "torch_ops": profiling.torch_ops(prof, steps),
        "conversions": _conversions(prof, ort_dir, skip, steps),
    }


def _conversions(prof: torch.profiler.profile, ort_dir: Path, skip: int, steps: int) -> dict[str, Any]:
    """Every fp32<->bf16 (any float<->float) conversion per step, wherever it ran: torch's and ORT's, and both."""
    by_torch = profiling.torch_conversions(prof, steps)
    by_ort = profiling.ort_conversions(ort_dir, skip_runs=skip, steps=steps)
    return {"torch": by_torch, "onnxruntime": by_ort, "total": profiling.total_conversions(by_torch, by_ort)}
