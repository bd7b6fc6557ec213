"""Accel modes as plugins: `conf/accel/<mode>.yaml` names its engine builder with `_target_`, and the module that
builder lives in is the whole engine.

An engine module provides (catalog.DECLARATIONS; the optional ones read through catalog.declared):
    NAME      the mode's name (recorded in run.json and checkpoints),
    build     `build(ctx: EngineContext, **settings) -> Engine`, where settings are the yaml's other keys; the
              engine has the Engine protocol's methods and whichever optional capabilities it offers
              (accel/engine.py: MicroBatches, GradNorm, Shards, ...; tested with isinstance, never by attribute),
    Settings  (optional) the dataclass schema of those keys, registered as `schema/accel/<NAME>`,
    problems  (optional) `problems(cfg) -> list[str]`: every reason the whole config cannot run on this engine
              (optimizer, debug options, distributed wrappers, ...), each naming the key to change.
    SIMPLICITY (optional) how much it changes of eager PyTorch's step, for ranking engines that measure equal
              (accel=auto picks the simplest); None: it trains with another engine (accel=auto itself).
    EXECUTED_BY (optional) what its describe()["executed_by"] says when it ran as it should (ORT's engines:
              "onnxruntime"; accel=auto refuses a candidate that says otherwise, ortflow-check a row; without it a
              row is judged by its losses alone).
    RUNS_IN_STEP (optional) the kinds of hooks and state updates (ortflow/model/hooks.py: Kind) it runs as eager
              does; the others it refuses before the first step (`EngineContext.refuse_unrun`).
    WHY_UNRUN (optional) {Kind: why it cannot run that kind}, where the reason is not ONNX Runtime's (hooks.py's).

The runner, loop, validation and distributed code never name a mode; they go through the functions below. A new
engine is one module plus one yaml file (found through `hydra.searchpath` when it lives outside ortflow); an
in-tree one is listed by accel/catalog.py from its yaml file and needs a line in pyproject.toml's import contracts
(its layer among the engines, and the contract that no engine imports this registry). An engine module imports
what it needs from below (accel/engine.py, accel/graph/, accel/compat/, ortflow.model, ...), never `ortflow.accel`
itself: what it needs of the other engines comes in its EngineContext, which holds no run config (an engine's
`problems(cfg)` is the one reader of the whole config). The catalog imports the engines by name, accel=auto among
them, and no engine module reads the catalog at import (tests/accel/test_import_cycle.py).
"""

import dataclasses
import importlib
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ortflow import machine
from ortflow.accel import catalog
from ortflow.accel.catalog import declared
from ortflow.accel.engine import Engine, EngineContext
from ortflow.config import AUTO
from ortflow.errors import OrtflowError

engines = catalog.engines  # the engines conf/accel offers that train themselves, simplest first


def engine_module(accel: DictConfig) -> ModuleType:
    """The module holding the builder that `accel._target_` names.

    Raises:
        OrtflowError: the target is missing, cannot be imported, or its module is not an engine module.
    """
    target = accel.get("_target_") if isinstance(accel, DictConfig) else None
    if not isinstance(target, str) or "." not in target:
        raise OrtflowError(
            "accel._target_ must name an engine builder (e.g. ortflow.accel.ortmodule.build); choose the mode with "
            "accel=<mode>."
        )
    module_name, _, function = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise OrtflowError(f"accel._target_={target}: module '{module_name}' cannot be imported ({err}).") from None
    if not callable(getattr(module, function, None)) or not isinstance(declared(module, "NAME"), str):
        raise OrtflowError(
            f"accel._target_={target} is not an engine builder: its module needs a NAME string and a callable "
            f"'{function}(ctx, **settings)' (see ortflow/accel/__init__.py)."
        )
    return module


def problems(cfg: DictConfig) -> list[str]:
    """Everything that keeps `cfg` from running on the engine it names (the engine's own checks)."""
    try:
        module = engine_module(cfg.accel)
    except OrtflowError as err:
        return [str(err)]
    settings = declared(module, "Settings")
    schema = OmegaConf.get_type(cfg.accel)
    if settings is not None and schema is not None and schema is not dict and schema is not settings:
        return [
            f"accel._target_={cfg.accel._target_} names the {module.NAME} engine, but the accel keys are those of "
            f"{schema.__name__}: choose the mode with accel={module.NAME} instead of changing accel._target_."
        ]
    check = declared(module, "problems")
    return list(check(cfg)) if check is not None else []


def settings_of(accel: DictConfig) -> dict[str, Any]:
    """The engine's own settings: the accel node's keys apart from `_target_`."""
    return {key: accel[key] for key in accel if key != "_target_"}


def build(accel: DictConfig, ctx: EngineContext) -> Engine:
    """Instantiate the engine `accel` names: `build(ctx, **settings)` of its module. With trainer.precision=auto
    (ctx.precision AUTO) a built-in engine is measured in each precision the CPU runs fast (accel/auto.py); another
    engine trains in bf16-mixed where the CPU has bf16 units."""
    module = engine_module(accel)
    builder = getattr(module, accel._target_.rpartition(".")[2])
    ctx = dataclasses.replace(ctx, engines_run=catalog.runs_in_step())  # for the engine's refusals to name others
    if ctx.precision == AUTO and module.NAME != "auto":
        auto = importlib.import_module("ortflow.accel.auto")
        if module.NAME in engines():
            return auto.with_precision_probe(module.NAME, ctx, settings_of(accel))
        ctx = dataclasses.replace(ctx, precision=machine.resolve_precision(AUTO))
    return builder(ctx, **settings_of(accel))


def register_schemas(store: Any) -> None:
    """Register the Settings of each engine conf/accel names as `schema/accel/<NAME>` in Hydra's ConfigStore."""
    for name, module in catalog.modules().items():
        if (settings := declared(module, "Settings")) is not None:
            store.store(group="schema/accel", name=name, node=settings)
