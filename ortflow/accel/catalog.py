"""The engines the config tree offers: every `conf/accel/<mode>.yaml`, by the module its `_target_` names.

The one list accel=auto's candidates, ortflow-check's rows, ortflow-bench's modes and the schema registration read.
It imports the engines (by name, when asked); no engine imports the registry back (`ortflow.accel`, an import-linter
contract in pyproject.toml): what an engine needs of the others (which of them runs a model's hooks, for its
refusal) reaches it through its EngineContext, and accel=auto, which probes the others, reads this module.
"""

import functools
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ortflow.errors import ConfigError
from ortflow.paths import config_dir

# What an engine module may declare besides its builder (ortflow/accel/__init__.py says what each one means): NAME is
# required, the others optional.
DECLARATIONS = ("NAME", "Settings", "problems", "TITLE", "SIMPLICITY", "EXECUTED_BY", "RUNS_IN_STEP", "WHY_UNRUN")


def declared(module: ModuleType | None, name: str, default: Any = None) -> Any:
    """Engine module `module`'s declaration `name` (one of DECLARATIONS), or `default` where it declares none (or
    there is no module): the one place an engine module's optional declarations are looked up."""
    if name not in DECLARATIONS:
        raise ValueError(f"{name} is not an engine module's declaration; those are {DECLARATIONS}")
    return getattr(module, name, default)


def modules(search: Sequence[Path] = ()) -> dict[str, ModuleType]:
    """Every engine module conf/accel/*.yaml names (accel=auto's included), by its NAME, in file-name order; then
    those of `search`'s accel/*.yaml (config directories on Hydra's search path: paths.search_dirs), where a file
    names an engine builder by its `_target_` (a file that only selects and overrides names none)."""
    return dict(_modules(tuple(Path(d) for d in search)))


@functools.cache
def _modules(search: tuple[Path, ...]) -> dict[str, ModuleType]:
    found: dict[str, ModuleType] = {}
    for folder in (config_dir(), *search):
        for path in sorted((folder / "accel").glob("*.yaml")):
            target = OmegaConf.load(path).get("_target_")
            if folder != config_dir() and not target:
                continue
            try:
                module = importlib.import_module(str(target).rpartition(".")[0])
            except ImportError as err:
                raise ConfigError(
                    f"{path}: its _target_ {target} names a module that cannot be imported ({err}); an engine's yaml "
                    "names its builder, e.g. _target_: my_pkg.engine.build (docs/engines.md)."
                ) from None
            if declared(module, "NAME") is not None:
                found.setdefault(module.NAME, module)
    return found


def engines(search: Sequence[Path] = ()) -> dict[str, ModuleType]:
    """The engines that train a model themselves (those with a SIMPLICITY: not accel=auto), simplest first; an engine
    of the search path without a SIMPLICITY comes after ortflow's own."""
    found, own = modules(search), modules()
    training = {name: m for name, m in found.items() if declared(m, "SIMPLICITY") is not None}
    ordered = dict(sorted(training.items(), key=lambda item: item[1].SIMPLICITY))
    return ordered | {name: m for name, m in found.items() if name not in ordered and name not in own}


def refusals(cfg: DictConfig) -> Callable[[str], list[str]]:
    """Engine name -> that engine's own reasons it cannot run `cfg` (its `problems(cfg)`; none without one): what
    accel=auto rules candidates out by (EngineContext.refusals)."""

    def of(name: str) -> list[str]:
        check = declared(engines()[name], "problems")
        return list(check(cfg)) if check is not None else []

    return of


def runs_in_step(search: Sequence[Path] = ()) -> dict[str, frozenset]:
    """What each training engine runs of a model's step as eager does (its RUNS_IN_STEP: ortflow/model/hooks.py's
    kinds of hooks and state updates), simplest engine first: what a refusal names as the engines that run it."""
    return {name: declared(m, "RUNS_IN_STEP", frozenset()) for name, m in engines(search).items()}
