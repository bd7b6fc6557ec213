"""`accel=auto`: time a few training steps of each engine (and each precision the CPU runs fast) on the user's own
model and batch, pick the fastest, and train with it.

Which engine wins depends on the CPU (whose matmuls are faster, torch's or ORT's; whether it has bf16 units) and on
the model (its width, convolutions, normalisation layers); a user should not have to know. The probe:
- builds every candidate engine on a copy of the model (its own ONNX files in a temporary folder), takes one untimed
  step (export, session creation) and two untimed warm-up steps, then times `probe_steps` steps on the run's example
  batch (the first batch of the training data, read without drawing from the loader). Its cost is bounded: one export
  and 3 + probe_steps steps per
  engine and precision. The random generators are restored after it: the run trains exactly as `accel=<choice>`
  would, bit for bit;
- prints its table and choice, records both in run.json (the engine's `auto` entry) and in every checkpoint: a
  resumed run keeps the choice without probing again;
- caches the result on this machine (~/.cache/ortflow/auto, keyed by what it measured: the model's structure, the
  batch's shapes, the loss, optimizer and engine settings, the versions and the CPU), so a sweep probes once per
  distinct model and batch shape;
- under DDP, rank 0 probes and every rank trains with its choice.
Engine settings given as `accel.*` (accel=auto accel.aten_conv=false) apply to whichever engine is chosen; a key
only one engine has applies to that one.
"""

import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from annotated_types import Ge, Interval
from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from ortflow import distributed, machine
from ortflow.accel import artifacts, none, ortmodule
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
ENGINES = {module.NAME: module for module in (none, ortmodule, artifacts)}
CACHE_FORMAT = 2
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
        ("probe_steps", int, ranged(5, Interval(ge=1, le=100))),  # timed steps per engine and precision
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


def probe_one(ctx: EngineContext, name: str, precision: str, settings: dict[str, Any], steps: int) -> Probe:
    """Build engine `name` on a copy of the model and time `steps` steps after an untimed first one."""
    result = Probe(name, precision)
    with tempfile.TemporaryDirectory(prefix=f"ortflow-auto-{name}-") as tmp:
        trial = dataclasses.replace(
            ctx,
            model=hooks.copy_model(ctx.model),  # with its parameters' hooks, which engines may refuse
            onnx_dir=Path(tmp),
            wrap=lambda module: module,
            reduce_loss=None,
            precision=precision,
        )
        engine = None
        try:
            start = time.perf_counter()
            engine = ENGINES[name].build(trial, **_settings_for(name, settings))
            loss = _step(engine, trial)
            result.first_step_s = time.perf_counter() - start
            for _ in range(WARMUP_STEPS):  # kernels picked and memory pooled for these shapes (bf16's first steps)
                loss = _step(engine, trial)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                loss = _step(engine, trial)
                times.append(time.perf_counter() - start)
            if not math.isfinite(loss):
                raise OrtflowError(f"its loss was {loss} on the example batch")
            result.step_ms = 1000 * statistics.median(times)
        except (OrtflowError, RuntimeError, ValueError) as err:
            result.error = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        finally:
            del engine
            gc.collect()
    return result


def cache_key(ctx: EngineContext, names: list[str], precisions: list[str], settings: dict[str, Any]) -> str:
    """What the probe measured, hashed: the model's structure and parameter shapes, the batch's shapes, the loss,
    optimizer and engine settings, the candidates and precisions, the versions and the CPU."""
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
        "machine": machine.describe(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


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


def _read_cache(key: str) -> list[Probe] | None:
    try:
        record = json.loads((cache_dir() / f"{key}.json").read_text())
        return [Probe(**probe) for probe in record["probes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: probe again


def _write_cache(key: str, probes: list[Probe]) -> None:
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / f".{key}.{os.getpid()}.tmp"
        staged.write_text(json.dumps({"probes": [dataclasses.asdict(p) for p in probes]}))
        os.replace(staged, folder / f"{key}.json")
    except OSError as err:  # a read-only home: the run goes on, the next one probes again
        log.info("accel=auto: the probe could not be cached (%s)", err)


def choose(probes: list[Probe]) -> Probe:
    """The fastest probe that ran (the earlier candidate on a tie)."""
    ran = [p for p in probes if p.step_ms is not None]
    if not ran:
        reasons = "; ".join(f"{p.label}: {p.error}" for p in probes)
        raise OrtflowError(f"accel=auto: no candidate engine could train this model ({reasons}).")
    return min(ran, key=lambda p: p.step_ms)


def table(probes: list[Probe], chosen: Probe, cached: bool, by: str = "accel=auto") -> Table:
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
    return t


def decide(
    ctx: EngineContext, settings: dict[str, Any], names: list[str], wanted: list[str]
) -> tuple[Probe, list[Probe], bool]:
    """Probe engines `names` in precisions `wanted` (or read the cache) on this process: the chosen probe, every probe,
    whether they came from the cache."""
    key = cache_key(ctx, names, wanted, settings)
    probes = _read_cache(key) if settings["cache"] else None
    cached = probes is not None
    if probes is None:
        state = _rng_state()
        try:
            probes = [probe_one(ctx, n, p, settings, settings["probe_steps"]) for p in wanted for n in names]
        finally:
            _set_rng_state(state)  # the probe's steps drew nothing the run will draw
        if settings["cache"] and any(p.step_ms is not None for p in probes):
            _write_cache(key, probes)
    return choose(probes), probes, cached


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
    own = {f.name: f.default for f in dataclasses.fields(Settings) if f.name in ("probe_steps", "cache", "timeout_s")}
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

        def probe() -> dict[str, Any]:
            chosen, found, cached = decide(ctx, settings, names, wanted)
            terminal.console().print(table(found, chosen, cached, by))
            terminal.console().print(
                f"{by} chose accel={chosen.engine} with trainer.precision={chosen.precision} "
                f"({chosen.step_ms:.1f} ms/step on the example batch)"
            )
            choice = {"accel": chosen.engine, "precision": chosen.precision, "cached": cached}
            return {"choice": choice, "probes": [dataclasses.asdict(p) for p in found]}

        decision = distributed.from_main(probe, settings["timeout_s"])
        choice, probes = decision["choice"], decision["probes"]
        log.info("%s: %s", by, json.dumps(decision))
    name, precision = choice["accel"], choice["precision"]
    try:
        engine = ENGINES[name].build(dataclasses.replace(ctx, precision=precision), **_settings_for(name, settings))
    except OrtflowError as err:
        raise ConfigError(f"{by} chose accel={name}, which then failed to build: {err}") from err
    return AutoEngine(engine, {**choice, "by": by, "title": ENGINES[name].TITLE}, probes)
