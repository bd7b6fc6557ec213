"""The engines the config tree offers: every `conf/accel/<mode>.yaml`, by the module its `_target_` names.

The one list accel=auto's candidates, ortflow-check's rows, ortflow-bench's modes and the schema registration read.
It imports the engines (by name, when asked); no engine imports the registry back (`ortflow.accel`, an import-linter
contract in pyproject.toml): what an engine needs of the others (which of them runs a model's hooks, for its
refusal) reaches it through its EngineContext, and accel=auto, which probes the others, reads this module.
"""

import functools
import importlib
from types import ModuleType

from omegaconf import OmegaConf

from ortflow.paths import config_dir


@functools.cache
def modules() -> dict[str, ModuleType]:
    """Every engine module conf/accel/*.yaml names (accel=auto's included), by its NAME, in file-name order."""
    found = {}
    for path in sorted((config_dir() / "accel").glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        module = importlib.import_module(str(target).rpartition(".")[0])
        found[module.NAME] = module
    return found


def engines() -> dict[str, ModuleType]:
    """The engines that train a model themselves (those with a SIMPLICITY: not accel=auto), simplest first."""
    training = {name: m for name, m in modules().items() if getattr(m, "SIMPLICITY", None) is not None}
    return dict(sorted(training.items(), key=lambda item: item[1].SIMPLICITY))


def runs_in_step() -> dict[str, frozenset]:
    """What each training engine runs of a model's step as eager does (its RUNS_IN_STEP: ortflow/model/hooks.py's
    kinds of hooks and state updates), simplest engine first: what a refusal names as the engines that run it."""
    return {name: getattr(m, "RUNS_IN_STEP", frozenset()) for name, m in engines().items()}
