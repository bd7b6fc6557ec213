"""`accel=auto`: time training steps of each engine (and each precision the CPU runs fast) on the user's own model and
batch, pick the fastest, and train with it.

Which engine wins depends on the CPU (whose matmuls are faster, torch's or ORT's; whether it has bf16 units) and on
the model (its width, convolutions, normalisation layers); a user should not have to know. The probe:
- candidates: the engines the config tree offers (accel/catalog.py: conf/accel/, the list ortflow-check and
  ortflow-bench use), those `accel.candidates` names and the config allows;
- a first pass builds every candidate engine on a copy of the model (its own ONNX files in a temporary folder),
  takes one untimed step (export, session creation) and two untimed warm-up steps, then times `probe_steps` steps
  on the run's example batch (the first batch of the training data, read without drawing from the loader). A
  candidate counts only when its loss is finite and its own record says it executed as it should (ORT's engines:
  ORT's run counters, not a fallback to PyTorch);
- a runoff then separates the two fastest: both built again, one step of each in turn (pairs close in time, so a
  change of the machine's load hits both), until the 90% confidence interval of the median ratio of their paired
  step times (the sign test's, distribution-free) excludes 1, or lies within 3% of it, or `budget_s` seconds have
  passed. Separated, the faster one trains; otherwise they are called equal and the simpler one trains (eager, then
  ORTModule, then the artifacts engine; fp32 before bf16-mixed). Its cost is bounded: one export and 3 +
  `probe_steps` steps per candidate, then at most `budget_s` seconds;
- the random generators are restored after it: the run trains exactly as `accel=<choice>` would, bit for bit;
- it prints its table and choice, records both in run.json (the engine's `auto` entry) and in every checkpoint: a
  resumed run keeps the choice without probing again;
- it caches the decision on this machine (~/.cache/ortflow/auto, keyed by what it measured: the model's structure,
  the batch's shapes, the loss, optimizer and engine settings, the versions (ortflow's included) and the CPU), so a
  sweep probes once per distinct model and batch shape. A failure is never cached (the next run probes again), and
  a cached choice that no longer builds is dropped and probed again;
- under DDP, rank 0 probes and every rank trains with its choice.
Engine settings given as `accel.*` (accel=auto accel.aten_conv=false) apply to whichever engine is chosen; a key
only one engine has applies to that one.
"""

import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from annotated_types import Ge, Interval
from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from ortflow import distributed, machine
from ortflow.accel import catalog
from ortflow.accel.compat import versions
from ortflow.accel.engine import EngineContext
from ortflow.config import AUTO, BF16, FP32
from ortflow.errors import ConfigError, OrtflowError
from ortflow.model import hooks
from ortflow.ranges import ranged
from ortflow.report import terminal

log = logging.getLogger(__name__)

NAME = "auto"
TITLE = "the fastest engine on this model and CPU, measured before training"
ENGINES = catalog.engines()  # simplest first
CACHE_FORMAT = 3
WARMUP_STEPS = 2  # untimed steps after the first: the first bf16 steps were slower than the rest (oneDNN's kernels)


def _engine_settings() -> dict[str, dataclasses.Field]:
    """Every setting of the candidate engines (first definition wins for a key two engines share)."""
    fields: dict[str, dataclasses.Field] = {}
    for module in ENGINES.values():
        for f in dataclasses.fields(module.Settings):
            if f.name != "_target_":
                fields.setdefault(f.name, f)
    return fields


def _make_settings() -> type:
    """auto's own settings, then every engine setting as an optional key (null: the chosen engine's default)."""
    own = [
        ("_target_", str, dataclasses.field(default="ortflow.accel.auto.build")),
        # The engines probed, in this order (ties keep the earlier one).
        ("candidates", list[str], dataclasses.field(default_factory=lambda: list(ENGINES))),
        ("probe_steps", int, ranged(5, Interval(ge=1, le=100))),  # timed steps per engine and precision, first pass
        # The runoff of the two fastest: at most this many seconds of paired steps before calling them equal
        ("budget_s", float, ranged(60.0, Ge(0))),
        ("cache", bool, dataclasses.field(default=True)),  # reuse a probe of the same model and batch on this machine
        ("timeout_s", int, ranged(1800, Ge(1))),  # DDP: how long the other ranks wait for rank 0's probe
    ]
    borrowed = [
        (name, f.type | None, dataclasses.field(default=None, metadata=f.metadata))
        for name, f in _engine_settings().items()
    ]
    settings = dataclasses.make_dataclass("Settings", own + borrowed)
    settings.__module__ = __name__
    settings.__doc__ = (
        "conf/accel/auto.yaml: the probe's settings, then every engine's (null: the chosen one's default)."
    )
    return settings


Settings = _make_settings()


def problems(cfg: DictConfig) -> list[str]:
    """Unknown candidates; a config no candidate can run (each one's own reasons, named)."""
    names = list(cfg.accel.candidates)
    if not names or (unknown := [n for n in names if n not in ENGINES]):
        wrong = f"{unknown} are not engines" if names else "is empty"
        return [f"accel.candidates={names} {wrong}; choose from {list(ENGINES)}."]
    if not candidates(cfg):
        reasons = [f"{name}: {'; '.join(_problems_of(cfg, name))}" for name in names]
        return [f"accel=auto: none of the candidate engines can run this config ({' | '.join(reasons)})."]
    return []


def _problems_of(cfg: DictConfig, name: str) -> list[str]:
    check = getattr(ENGINES[name], "problems", None)
    return list(check(cfg)) if check is not None else []


def candidates(cfg: DictConfig) -> list[str]:
    """The candidate engines that can run this config (their own checks pass)."""
    return [name for name in cfg.accel.candidates if name in ENGINES and not _problems_of(cfg, name)]


def precisions(requested: str) -> list[str]:
    """The precisions to probe: trainer.precision=auto probes bf16-mixed too where the CPU has bf16 units."""
    if requested == AUTO:
        return [FP32, BF16] if machine.bf16_units() else [FP32]
    return [requested]


def _settings_for(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The given (non-null) settings that engine `name` has."""
    own = {f.name for f in dataclasses.fields(ENGINES[name].Settings)}
    return {key: value for key, value in settings.items() if key in own and value is not None}


@dataclasses.dataclass
class Probe:
    """One candidate's measurement."""

    engine: str
    precision: str
    step_ms: float | None = None  # median of the timed steps
    first_step_s: float | None = None  # build + the untimed first step
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.engine} {self.precision}"


def _rng_state() -> tuple:
    return torch.random.get_rng_state(), np.random.get_state(), random.getstate()


def _set_rng_state(state: tuple) -> None:
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
            precision=precision,
        )
        engine = None
        try:
            engine = ENGINES[name].build(trial, **_settings_for(name, settings))
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
    promised = getattr(ENGINES[name], "EXECUTED_BY", None)
    said = engine.describe().get("executed_by")
    if promised is not None and said != promised:
        return f"its steps were executed by {said}, not {promised}"
    return None


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


CONFIDENCE = 0.9  # the runoff's confidence in which of two candidates is faster
EQUAL_WITHIN = 1.03  # a ratio interval inside [1/1.03, 1.03]: the two are equal (3%), the simpler one trains
MIN_PAIRS = 5  # the fewest pairs whose sign-test interval can exclude 1 at 90% (both ends the extremes)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The distribution-free confidence interval of a median (the sign test's): order statistics k and n + 1 - k of
    the n values, k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2."""
    ordered = sorted(values)
    n = len(ordered)
    tail, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:  # too few values for this confidence: no bound
        return 0.0, math.inf
    return ordered[k - 1], ordered[n - k]


@dataclasses.dataclass
class Runoff:
    """The paired timing of the two fastest candidates of the first pass."""

    faster: str  # the first pass's fastest (label)
    other: str  # the runner-up
    pairs: int = 0
    ratio: float | None = None  # median of other's / faster's step time over the pairs
    low: float | None = None  # its confidence interval (CONFIDENCE)
    high: float | None = None
    verdict: str = "equal"  # "separated" (one is faster at CONFIDENCE) or "equal" (within 3%, or not separated)
    seconds: float = 0.0
    error: str | None = None


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


def _simplicity(probe: Probe) -> tuple[int, int]:
    return list(ENGINES).index(probe.engine), [FP32, BF16].index(probe.precision)


def cache_key(ctx: EngineContext, names: list[str], precisions: list[str], settings: dict[str, Any]) -> str:
    """What the probe measured, hashed: the model's structure and parameter shapes, the batch's shapes, the loss,
    optimizer and engine settings, the candidates and precisions, the versions (ortflow's too) and the CPU."""
    inputs, targets = ctx.example
    flat = ctx.layout.flatten(inputs)
    what = {
        "format": CACHE_FORMAT,
        "model": repr(ctx.model),
        "parameters": [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in ctx.model.named_parameters()],
        "inputs": [(list(t.shape), str(t.dtype)) for t in (*flat, targets)],
        "loss": _describe(ctx.loss),
        "optim": OmegaConf.to_container(ctx.optim, enum_to_str=True)
        if isinstance(ctx.optim, DictConfig)
        else repr(ctx.optim),
        "grad_clip": ctx.grad_clip,
        "accumulate": ctx.accumulate,
        "candidates": names,
        "precisions": precisions,
        "settings": {k: str(v) for k, v in sorted(settings.items()) if v is not None},
        "versions": versions.installed_versions(),
        "ortflow": ortflow_version(),
        "machine": machine.describe(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


@functools.cache
def ortflow_version() -> str:
    """ortflow's release and a digest of its engines' code (accel/): a checkout that changed an engine probes anew."""
    digest = hashlib.sha256()
    root = Path(catalog.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    try:
        release = importlib.metadata.version("ortflow")
    except importlib.metadata.PackageNotFoundError:
        release = "unknown"
    return f"{release}+{digest.hexdigest()[:12]}"


def _describe(obj: Any) -> str:
    """An object's class and settings, without the memory address a default repr carries."""
    text = repr(obj)
    if " at 0x" in text:
        settings = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        text = f"{type(obj).__module__}.{type(obj).__qualname__}({json.dumps(settings, sort_keys=True, default=str)})"
    return text


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "ortflow" / "auto"


def _read_cache(key: str) -> dict[str, Any] | None:
    """A cached decision: the probes that ran (failures are never cached), the runoff, the choice."""
    try:
        record = json.loads((cache_dir() / f"{key}.json").read_text())
        record["probes"] = [Probe(**probe) for probe in record["probes"]]
        record["runoff"] = Runoff(**record["runoff"]) if record.get("runoff") else None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: probe again


def _write_cache(key: str, probes: list[Probe], run: Runoff | None) -> None:
    ran = [dataclasses.asdict(p) for p in probes if p.step_ms is not None]
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / f".{key}.{os.getpid()}.tmp"
        record = {"probes": ran, "runoff": dataclasses.asdict(run) if run is not None and not run.error else None}
        staged.write_text(json.dumps(record))
        os.replace(staged, folder / f"{key}.json")
    except OSError as err:  # a read-only home: the run goes on, the next one probes again
        log.info("accel=auto: the probe could not be cached (%s)", err)


def forget(key: str) -> None:
    """Drop a cached decision (its choice no longer builds)."""
    (cache_dir() / f"{key}.json").unlink(missing_ok=True)


def _ran(probes: list[Probe]) -> list[Probe]:
    """The probes that ran, fastest first."""
    return sorted((p for p in probes if p.step_ms is not None), key=lambda p: p.step_ms)


def choose(probes: list[Probe], run: Runoff | None = None, steps: int | None = None) -> Probe:
    """The fastest probe that ran; where a runoff called the two fastest equal, the simpler of them. With the run's
    length (`steps`), one-time costs are weighed too (`weigh`).

    Raises:
        OrtflowError: no candidate ran.
    """
    ran = _ran(probes)
    if not ran:
        reasons = "; ".join(f"{p.label}: {p.error}" for p in probes)
        raise OrtflowError(f"accel=auto: no candidate engine could train this model ({reasons}).")
    if run is None or run.error or len(ran) < 2:
        return weigh(ran[0], ran, steps)
    first, second = ran[0], ran[1]
    if run.verdict == "separated":
        return weigh(first if run.ratio is not None and run.ratio > 1.0 else second, ran, steps)
    return weigh(min((first, second), key=_simplicity), ran, steps)


def run_seconds(probe: Probe, steps: int) -> float:
    """A probe's estimate of a run of `steps` steps: its start-up (build, export or compilation, the first step)
    and the rest at its measured step time."""
    return (probe.first_step_s or 0.0) + max(steps - 1, 0) * (probe.step_ms or 0.0) / 1000


def weigh(fastest: Probe, ran: list[Probe], steps: int | None) -> Probe:
    """`fastest` (by step time), unless a candidate that starts quicker ends a run of `steps` steps sooner: a short
    run does not pick an engine whose start-up (ORT's export, torch.compile's compilation) costs more than its faster
    steps save."""
    if steps is None:
        return fastest
    quicker = [p for p in ran if (p.first_step_s or 0.0) < (fastest.first_step_s or 0.0)]
    best = min(quicker, key=lambda p: run_seconds(p, steps), default=fastest)
    return best if run_seconds(best, steps) < run_seconds(fastest, steps) else fastest


def table(probes: list[Probe], chosen: Probe, cached: bool, by: str = "accel=auto", run: Runoff | None = None) -> Table:
    fastest = chosen.step_ms
    title = f"{by}: " + ("the probe of this model and batch cached on this machine" if cached else "probe")
    t = Table(title=title, title_justify="left")
    for col in ("engine", "precision", "ms/step", "x fastest", "first step", ""):
        t.add_column(col, justify="left" if col in ("engine", "precision", "") else "right")
    for p in probes:
        if p.step_ms is None:
            t.add_row(p.engine, p.precision, "failed", "", "", (p.error or "")[:80])
            continue
        mark = "chosen" if p is chosen else ""
        first = f"{p.first_step_s:.1f} s" if p.first_step_s is not None else "-"
        t.add_row(p.engine, p.precision, f"{p.step_ms:.1f}", f"{fastest / p.step_ms:.2f}", first, mark)
    if run is not None:
        t.caption = runoff_line(run)
    return t


def runoff_line(run: Runoff) -> str:
    if run.error:
        return f"runoff of {run.faster} and {run.other}: failed ({run.error}); the first pass decided"
    interval = f"[{run.low:.3f}, {run.high:.3f}]" if run.low is not None else "(too few pairs)"
    said = "one is faster" if run.verdict == "separated" else "equal: the simpler one trains"
    return (
        f"runoff of {run.faster} and {run.other}: {run.pairs} paired steps in {run.seconds:.0f} s, step-time ratio "
        f"{run.ratio:.3f}, {CONFIDENCE:.0%} interval {interval}: {said}"
    )


def decide(
    ctx: EngineContext, settings: dict[str, Any], names: list[str], wanted: list[str]
) -> tuple[Probe, list[Probe], bool, Runoff | None]:
    """Probe engines `names` in precisions `wanted` (the cached probes and runoff where there are some) on this
    process: the chosen probe, every probe, whether all came from the cache, the runoff."""
    key = cache_key(ctx, names, wanted, settings)
    record = _read_cache(key) if settings["cache"] else None
    known = {(p.engine, p.precision): p for p in (record["probes"] if record else [])}
    missing = [(n, p) for p in wanted for n in names if (n, p) not in known]
    run = record["runoff"] if record else None
    state = _rng_state()
    try:
        probes = [
            known.get((n, p)) or probe_one(ctx, n, p, settings, settings["probe_steps"]) for p in wanted for n in names
        ]
        ran = _ran(probes)
        pair = {ran[0].label, ran[1].label} if len(ran) > 1 else set()
        if run is not None and {run.faster, run.other} != pair:
            run = None  # another pair is in front now
        if run is None and pair and settings["budget_s"] > 0:
            run = runoff(ctx, ran[0], ran[1], settings)
    finally:
        _set_rng_state(state)  # the probe's steps drew nothing the run will draw
    cached = not missing and record is not None and (run is None or run is record["runoff"])
    if settings["cache"] and not cached and ran:
        _write_cache(key, probes, run)
    return choose(probes, run, run_length(ctx)), probes, cached, run


def run_length(ctx: EngineContext) -> int | None:
    """The steps the run will train (trainer.max_steps; micro-batches count as one step each), for weighing one-time
    costs; None without a config."""
    if ctx.config is None:
        return None
    return int(ctx.config.trainer.max_steps) * max(ctx.accumulate, 1)


class AutoEngine:
    """The chosen engine, with the probe in its description (run.json) and its choice for checkpoints."""

    def __init__(self, engine: Any, choice: dict[str, Any], probes: list[dict[str, Any]]) -> None:
        self._engine = engine
        self.choice = choice  # {"accel": ..., "precision": ...}: checkpoints keep it, a resume reuses it
        self.probes = probes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def describe(self) -> dict[str, Any]:
        return {**self._engine.describe(), "precision": self.choice["precision"], "auto": self.auto_record()}

    def auto_record(self) -> dict[str, Any]:
        return {"choice": self.choice, "probes": self.probes}


def build(ctx: EngineContext, **settings: Any) -> AutoEngine:
    """`accel=auto`: the fastest candidate engine (in each precision trainer.precision allows), measured."""
    names = candidates(ctx.config) if ctx.config is not None else list(settings["candidates"])
    return _build(ctx, settings, names, "accel=auto")


def with_precision_probe(name: str, ctx: EngineContext, settings: dict[str, Any]) -> AutoEngine:
    """`trainer.precision=auto` with engine `name`: that engine in fp32 and, on a CPU with bf16 units, in bf16-mixed,
    measured the same way; the faster one trains."""
    probe_keys = ("probe_steps", "budget_s", "cache", "timeout_s")
    own = {f.name: f.default for f in dataclasses.fields(Settings) if f.name in probe_keys}
    return _build(ctx, {**own, **settings, "candidates": [name]}, [name], "trainer.precision=auto")


def _build(ctx: EngineContext, settings: dict[str, Any], names: list[str], by: str) -> AutoEngine:
    wanted = precisions(ctx.config.trainer.precision if ctx.config is not None else ctx.precision)
    probes: list[dict[str, Any]] = []
    resumable = ENGINES if by == "accel=auto" else names  # accel=auto keeps whichever engine it chose before
    if ctx.resumed_choice and ctx.resumed_choice.get("accel") in resumable:
        choice = {**ctx.resumed_choice, "resumed": True}
        log.warning(
            "%s: keeping the choice of the run being resumed: accel=%s, trainer.precision=%s (no probe)",
            by,
            choice["accel"],
            choice["precision"],
        )
    elif len(names) * len(wanted) == 1:  # nothing to choose between
        choice = {"accel": names[0], "precision": wanted[0], "probed": False}
    else:
        choice, probes = _probed(ctx, settings, names, wanted, by)
    name, precision = choice["accel"], choice["precision"]
    try:
        engine = ENGINES[name].build(dataclasses.replace(ctx, precision=precision), **_settings_for(name, settings))
    except OrtflowError as err:
        if not choice.get("cached"):
            raise ConfigError(f"{by} chose accel={name}, which then failed to build: {err}") from err
        log.warning("%s: the cached choice accel=%s no longer builds (%s); probing again", by, name, err)
        forget(cache_key(ctx, names, wanted, settings))
        return _build(ctx, settings, names, by)  # probed again: a failing candidate is never chosen
    return AutoEngine(engine, {**choice, "by": by, "title": ENGINES[name].TITLE}, probes)


def _probed(
    ctx: EngineContext, settings: dict[str, Any], names: list[str], wanted: list[str], by: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The probe's choice and probes, made on rank 0 (the others wait for it)."""

    def probe() -> dict[str, Any]:
        chosen, found, cached, run = decide(ctx, settings, names, wanted)
        terminal.console().print(table(found, chosen, cached, by, run))
        terminal.console().print(
            f"{by} chose accel={chosen.engine} with trainer.precision={chosen.precision} "
            f"({chosen.step_ms:.1f} ms/step on the example batch)"
        )
        choice = {"accel": chosen.engine, "precision": chosen.precision, "cached": cached}
        return {
            "choice": choice,
            "probes": [dataclasses.asdict(p) for p in found],
            "runoff": dataclasses.asdict(run) if run is not None else None,
        }

    decision = distributed.from_main(probe, settings["timeout_s"])
    log.info("%s: %s", by, json.dumps(decision))
    return {**decision["choice"], "runoff": decision["runoff"]}, decision["probes"]
