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

import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from annotated_types import Ge, Interval
from omegaconf import DictConfig

from ortflow import distributed, machine
from ortflow.accel import catalog
from ortflow.accel.auto_cache import cache_key, forget, read_cache, write_cache
from ortflow.accel.auto_decision import Probe, Runoff, choose, measured, table
from ortflow.accel.auto_probe import probe_one, rng_state, runoff, set_rng_state, settings_for, warm_up
from ortflow.accel.engine import Engine, EngineContext, Wrapper, forwarding
from ortflow.config import AUTO, BF16, FP32
from ortflow.errors import ConfigError, OrtflowError
from ortflow.ranges import ranged
from ortflow.report import terminal

log = logging.getLogger(__name__)


NAME = "auto"


TITLE = "the fastest engine on this model and CPU, measured before training"


def engines() -> dict[str, ModuleType]:
    """The candidate engines, simplest first: the catalog's, read when asked. Never at import: the catalog imports
    this module (conf/accel/auto.yaml names it), so a read at import would hand it this module half-imported
    (tests/accel/test_import_cycle.py)."""
    return catalog.engines()


def _engine_settings() -> dict[str, dataclasses.Field]:
    """Every setting of the candidate engines (first definition wins for a key two engines share)."""
    fields: dict[str, dataclasses.Field] = {}
    for module in engines().values():
        for f in dataclasses.fields(module.Settings):
            if f.name != "_target_":
                fields.setdefault(f.name, f)
    return fields


def _make_settings() -> type:
    """auto's own settings, then every engine setting as an optional key (null: the chosen engine's default)."""
    own = [
        ("_target_", str, dataclasses.field(default="ortflow.accel.auto.build")),
        # The engines probed, in this order (ties keep the earlier one).
        ("candidates", list[str], dataclasses.field(default_factory=lambda: list(engines()))),
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


@functools.cache
def settings_class() -> type:
    """auto's Settings, made once, when first asked for (it reads the catalog: not at import)."""
    return _make_settings()


def __getattr__(name: str) -> Any:
    """`Settings`, the engine module's schema (ortflow/accel/__init__.py), made on first use (PEP 562)."""
    if name == "Settings":
        return settings_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def problems(cfg: DictConfig) -> list[str]:
    """Unknown candidates; a config no candidate can run (each one's own reasons, named)."""
    names = list(cfg.accel.candidates)
    if not names or (unknown := [n for n in names if n not in engines()]):
        wrong = f"{unknown} are not engines" if names else "is empty"
        return [f"accel.candidates={names} {wrong}; choose from {list(engines())}."]
    if not candidates(cfg):
        reasons = [f"{name}: {'; '.join(_problems_of(cfg, name))}" for name in names]
        return [f"accel=auto: none of the candidate engines can run this config ({' | '.join(reasons)})."]
    return []


def _problems_of(cfg: DictConfig, name: str) -> list[str]:
    return catalog.refusals(cfg)(name)


def candidates(cfg: DictConfig) -> list[str]:
    """The candidate engines that can run this config (their own checks pass)."""
    return runnable(list(cfg.accel.candidates), catalog.refusals(cfg))


def runnable(names: list[str], refusals: Callable[[str], list[str]]) -> list[str]:
    """The engines of `names` that are engines and that `refusals` (engine name -> its reasons) does not rule out."""
    return [name for name in names if name in engines() and not refusals(name)]


def precisions(requested: str) -> list[str]:
    """The precisions to probe: trainer.precision=auto probes bf16-mixed too where the CPU has bf16 units."""
    if requested == AUTO:
        return [FP32, BF16] if machine.bf16_units() else [FP32]
    return [requested]


def decide(
    ctx: EngineContext, settings: dict[str, Any], names: list[str], wanted: list[str]
) -> tuple[Probe, list[Probe], bool, Runoff | None]:
    """Probe engines `names` in precisions `wanted` (the cached probes and runoff where there are some) on this
    process: the chosen probe, every probe, whether all came from the cache, the runoff."""
    key = cache_key(ctx, names, wanted, settings)
    record = read_cache(key) if settings["cache"] else None
    known = {(p.engine, p.precision): p for p in (record["probes"] if record else [])}
    missing = [(n, p) for p in wanted for n in names if (n, p) not in known]
    run = record["runoff"] if record else None
    state = rng_state()
    try:
        if "none" in names and ("none", wanted[0]) in missing:
            # Eager is probed first: without this, its first step carried the process's own start-up, and a short
            # run weighed it as slower to start than an engine that exports its model (ORTModule, 1.5 s against 1.8)
            warm_up(ctx, "none", wanted[0], settings)
        probes = [
            known.get((n, p)) or probe_one(ctx, n, p, settings, settings["probe_steps"]) for p in wanted for n in names
        ]
        ran = measured(probes)
        pair = {ran[0].label, ran[1].label} if len(ran) > 1 else set()
        if run is not None and {run.faster, run.other} != pair:
            run = None  # another pair is in front now
        if run is None and pair and settings["budget_s"] > 0:
            run = runoff(ctx, ran[0], ran[1], settings)
    finally:
        set_rng_state(state)  # the probe's steps drew nothing the run will draw
    cached = not missing and record is not None and (run is None or run is record["runoff"])
    if settings["cache"] and not cached and ran:
        write_cache(key, probes, run)
    return choose(probes, run, run_length(ctx)), probes, cached, run


def run_length(ctx: EngineContext) -> int | None:
    """The steps the run will train (trainer.max_steps; micro-batches count as one step each), for weighing one-time
    costs; None where the context does not say."""
    if ctx.max_steps is None:
        return None
    return int(ctx.max_steps) * max(ctx.accumulate, 1)


class AutoEngine(Wrapper):
    """The chosen engine, with the probe in its description (run.json) and its choice for checkpoints.

    Its optional capabilities (accel/engine.py: train_micro, last_grad_norm, an ORT engine's state, ...) are exactly
    the chosen engine's: `auto_engine` makes it with engine.forwarding, which adds those the chosen engine has."""

    choice: dict[str, Any]  # {"accel": ..., "precision": ...}: checkpoints keep it, a resume reuses it

    def __init__(self, engine: Engine, choice: dict[str, Any], probes: list[dict[str, Any]]) -> None:
        super().__init__(engine)
        self.choice = choice
        self.probes = probes

    def describe(self) -> dict[str, Any]:
        return {**self.wrapped.describe(), "precision": self.choice["precision"], "auto": self.auto_record()}

    def auto_record(self) -> dict[str, Any]:
        return {"choice": self.choice, "probes": self.probes}


def auto_engine(engine: Engine, choice: dict[str, Any], probes: list[dict[str, Any]]) -> AutoEngine:
    """The AutoEngine around `engine`, offering the capabilities `engine` offers."""
    return forwarding(AutoEngine, engine)(engine, choice, probes)


def build(ctx: EngineContext, **settings: Any) -> AutoEngine:
    """`accel=auto`: the fastest candidate engine (in each precision trainer.precision allows), measured."""
    asked = list(settings["candidates"])
    names = runnable(asked, ctx.refusals) if ctx.refusals is not None else asked
    return _build(ctx, settings, names, "accel=auto")


def with_precision_probe(name: str, ctx: EngineContext, settings: dict[str, Any]) -> AutoEngine:
    """`trainer.precision=auto` with engine `name`: that engine in fp32 and, on a CPU with bf16 units, in bf16-mixed,
    measured the same way; the faster one trains."""
    probe_keys = ("probe_steps", "budget_s", "cache", "timeout_s")
    own = {f.name: f.default for f in dataclasses.fields(settings_class()) if f.name in probe_keys}
    return _build(ctx, {**own, **settings, "candidates": [name]}, [name], "trainer.precision=auto")


def _build(ctx: EngineContext, settings: dict[str, Any], names: list[str], by: str) -> AutoEngine:
    wanted = precisions(ctx.precision)  # trainer.precision: auto probes bf16-mixed too
    probes: list[dict[str, Any]] = []
    resumable = engines() if by == "accel=auto" else names  # accel=auto keeps whichever engine it chose before
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
        engine = engines()[name].build(dataclasses.replace(ctx, precision=precision), **settings_for(name, settings))
    except OrtflowError as err:
        if not choice.get("cached"):
            raise ConfigError(f"{by} chose accel={name}, which then failed to build: {err}") from err
        log.warning("%s: the cached choice accel=%s no longer builds (%s); probing again", by, name, err)
        forget(cache_key(ctx, names, wanted, settings))
        return _build(ctx, settings, names, by)  # probed again: a failing candidate is never chosen
    return auto_engine(engine, {**choice, "by": by, "title": engines()[name].TITLE}, probes)


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
