"""One benchmark measurement in its own process (a process per measurement gives each mode its own peak memory
and a cold first step):

    python -m ortflow.bench.worker --result FILE --budget SECONDS [--steps N] [--profile] MODE [OVERRIDES]

The result (or the error) is written as JSON to FILE. Everything the process prints (ONNX Runtime's native log
lines, torch's notices and warnings, ortflow's own log records) goes to its stdout and stderr, which ortflow-bench
points at the bench's log file.

How many steps are timed is chosen like timeit's autorange: after the first step (export, session creation and
compilation land there) and a fixed few warm-up steps, steps are timed one by one until a short calibration
time has passed; their median time then decides how many steps fit in the budget.
"""

import argparse
import contextlib
import copy
import ctypes
import gc
import itertools
import json
import logging
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from ortflow.accel import compat
from ortflow.accel.engine import Engine
from ortflow.bench.plan import MODES, mode_config
from ortflow.config import register_configs
from ortflow.data import Data
from ortflow.data.resumable import ResumableBatches
from ortflow.model.freeze import ParameterCount
from ortflow.report import profile as profiling
from ortflow.report.logger import RunLogger
from ortflow.run.runner import build_data, build_engine, build_model, example_batch
from ortflow.run.seeding import seed_everything
from ortflow.run.trainer import train_loop
from ortflow.step import loss
from ortflow.step.batch import batch_size, layout_of, split_batch
from ortflow.step.loss import EvalResult, Loss
from ortflow.validate import validate

PAIRS = 2  # timed passes of a bare loop and of ortflow's loop, alternated: samples/s is the bare passes' median
CALIBRATION_S = 1.0  # at most this long (and at most a tenth of the budget) timing single steps to choose a count
PROFILE_MAX_STEPS = 50  # profiled steps at most: ORT's trace holds every node's every run
POOL = 16  # distinct batches the timed steps cycle through (fetched before any timing: memory stays bounded)
PARENT_ENV = "ORTFLOW_BENCH_PARENT"  # the bench's pid: the worker ends when that process does


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


def model_flops(model: torch.nn.Module, data: Data, objective: Loss) -> int:
    """FLOPs of one training step (forward + backward), counted by torch: on a copy of the model on the meta
    device (shapes only, no arithmetic: free at any size), or, for a model that cannot run there (a transformers
    model calls .item()), on the model itself on the CPU, its buffers, gradients and the RNG restored afterwards (a
    copy would add the model's size to the peak memory the bench reports)."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs, targets = example_batch(data.train)
    tensors = layout_of(inputs).flatten(inputs)
    for device in ("meta", "cpu"):
        try:
            with contextlib.ExitStack() as stack:
                if device == "meta":
                    counted = copy.deepcopy(model).to(device).train()
                else:
                    counted = stack.enter_context(_restored_after(model)).train()
                with FlopCounterMode(display=False) as counter:
                    args = tuple(t.to(device) for t in tensors)
                    objective(layout_of(inputs).call(counted, args), targets.to(device)).backward()
                return counter.get_total_flops()
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
            logging.getLogger(__name__).info("FLOPs not countable on %s (%s)", device, err)
            if device == "cpu":
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _restored_after(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model`, whose buffers (BatchNorm's statistics), training mode, gradients and the torch RNG (dropout) are as
    before once the block ends."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    training = model.training
    with torch.random.fork_rng():
        try:
            yield model
        finally:
            for param in model.parameters():
                param.grad = None
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
            model.train(training)


def _start(args: argparse.Namespace, passes: int, scratch: Path, max_steps: int | None = None) -> dict[str, Any]:
    """Config, data, model and engine for mode `args.mode` (a mode name, optionally with its own overrides,
    `ortmodule:k=v;k2=v2`), through the first step, the warm-up steps and the step-count calibration."""
    mode = args.mode.partition(":")[0]
    cfg = mode_config(args.mode, args.overrides)
    validate(cfg)
    seed_everything(cfg.seed)
    data: Data = build_data(cfg)
    model: torch.nn.Module = build_model(cfg, data)
    flops = model_flops(model, data, loss.build(cfg.loss))
    if mode == "compile":
        model = torch.compile(model)
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
        "parameters": ParameterCount.of(model).as_dict(),  # before torch.compile wraps it: the same parameters
        "batch_size": batch_size(first[0]),
        **chosen,
    }


def _counters(engine: Engine) -> dict[str, Any]:
    """The engine's own account of what ran (ORT's run counters among it), JSON-safe."""
    return {k: v for k, v in engine.describe().items() if isinstance(v, str | int | float | bool)}


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Samples/s, first step, peak memory, FLOPs and the runner's overhead of mode `args.mode`."""
    s = _start(args, passes=2 * PAIRS, scratch=scratch)
    mode, cfg, data, engine, run_dir, batches = s["mode"], s["cfg"], s["data"], s["engine"], s["run_dir"], s["batches"]
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
        proxy, logger = Timed(engine), RunLogger(run_dir, cfg.logger, steps)
        start = time.perf_counter()
        train_loop(proxy, iter(timed), data.val, trainer, cfg.optim, cfg.scheduler, logger)
        loop_s = time.perf_counter() - start - proxy.eval_s
        loop.append(loop_s)
        outside.append((loop_s - proxy.train_s) / proxy.train_s)  # the loop's own time, beside the engine's
        logger.close()
    bare_s = statistics.median(bare)
    return {
        "mode": args.mode,
        "executed_by": "pytorch (torch.compile)" if mode == "compile" else engine.describe()["executed_by"],
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
    os.environ[compat.ORT_PROFILE_DIR] = str(ort_dir)
    s = _start(args, passes=1, scratch=scratch, max_steps=PROFILE_MAX_STEPS)
    engine, steps = s["engine"], s["steps"]
    timed = list(itertools.islice(s["batches"], steps))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
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
    }


def _end_with_parent() -> None:
    """Linux: have the kernel send SIGTERM when the bench that started this process dies (even by SIGKILL), so no
    measurement runs on orphaned; if it is gone already, end now (a bench killed while this process imported)."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        sys.exit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ortflow.bench.worker")
    p.add_argument("--result", type=Path, required=True, help="where the result (or the error) is written, as JSON")
    p.add_argument("--budget", type=float, default=10.0, help="seconds of timed steps")
    p.add_argument("--min-steps", type=int, default=2, help="timed steps per pass at least")
    p.add_argument("--steps", type=int, default=None, help="timed steps per pass (instead of the budget)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first one")
    p.add_argument("--profile", action="store_true", help="operators per step instead of timing")
    p.add_argument("mode")
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _end_with_parent()
    # This process's stderr is the bench's log: ortflow's records (ORT's native lines among them) and other
    # libraries' warnings go there, each with its origin.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.captureWarnings(True)
    if args.mode.partition(":")[0] not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, optionally followed by :overrides")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stopped: scratch removed
    register_configs()
    torch.manual_seed(0)
    task = profile if args.profile else measure
    with tempfile.TemporaryDirectory(prefix="ortflow-bench-") as scratch:
        try:
            result = task(args, Path(scratch))
        except Exception as err:  # a failed measurement is a row of the report, not a crash of the bench
            traceback.print_exc()
            result = {"mode": args.mode, "error": f"{type(err).__name__}: {err}".strip()[:2000]}
        gc.collect()  # engines (and their ORT sessions) end before their files go
    partial = args.result.with_name(args.result.name + ".partial")
    partial.write_text(json.dumps(result))
    partial.replace(args.result)  # whole or absent, whenever this process is killed
    if "error" in result:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
