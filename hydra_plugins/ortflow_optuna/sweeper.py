"""An Optuna sweeper for Hydra, on Optuna's public ask-and-tell API, whose trials can be pruned.

Hydra's own Optuna sweeper (hydra-optuna-sweeper) requires optuna < 3 and only sees a job's final return value,
so it cannot prune. Here each trial is one Hydra job run by the in-process basic launcher; while it trains, its
evaluations are reported to the trial (ortflow/run/pruning.py) and the study's pruner may stop it early, which the job
records as status "pruned". The study lives in an SQLite file in the sweep dir (or `storage`), so running the same
command again with the same hydra.sweep.dir resumes an interrupted sweep: finished trials (completed or pruned)
count toward n_trials, a trial cut short by the interruption is marked failed and replaced.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.ortflow_optuna.sweeper.OptunaSweeper"
    direction: str = "minimize"  # minimize | maximize the job's `objective`
    n_trials: int = 8  # finished trials (completed or pruned) the sweep runs to
    study_name: str = "ortflow"
    storage: str | None = None  # null: sqlite:///<sweep dir>/optuna.db
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": 0})
    pruner: Any = field(default_factory=lambda: {"_target_": "optuna.pruners.MedianPruner"})  # null: no pruning
    # key -> {type: float|int|categorical, low, high, log, step, choices}
    params: dict[str, Any] = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/sweeper", name="ortflow_optuna", node=OptunaSweeperConf, provider="ortflow")


def _built(node: Any) -> Any:
    """Hydra instantiates the sweeper's nested `_target_` nodes itself; a plain config node is built here."""
    return instantiate(node) if isinstance(node, dict | DictConfig) else node


def suggest(trial: Any, name: str, spec: dict[str, Any]) -> Any:
    """One value for `name` from the trial, as `spec` describes its range."""
    kind = spec.get("type", "float")
    if kind == "categorical":
        return trial.suggest_categorical(name, list(spec["choices"]))
    if kind == "int":
        return trial.suggest_int(name, spec["low"], spec["high"], step=spec.get("step", 1), log=spec.get("log", False))
    if kind == "float":
        return trial.suggest_float(name, spec["low"], spec["high"], step=spec.get("step"), log=spec.get("log", False))
    raise ValueError(f"hydra.sweeper.params.{name}: type must be float, int or categorical, not {kind!r}")


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        direction: str,
        n_trials: int,
        study_name: str,
        storage: str | None,
        sampler: Any,
        pruner: Any,
        params: dict[str, Any],
    ) -> None:
        self.direction, self.n_trials, self.study_name = direction, n_trials, study_name
        self.storage, self.sampler, self.pruner = storage, sampler, pruner
        self.params = {k: OmegaConf.to_container(v) if isinstance(v, DictConfig) else v for k, v in params.items()}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.sweep_dir = Path(config.hydra.sweep.dir)

    def _study(self) -> Any:
        import optuna

        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        storage = self.storage or f"sqlite:///{(self.sweep_dir / 'optuna.db').resolve()}"
        return optuna.create_study(
            study_name=self.study_name,
            storage=storage,
            sampler=_built(self.sampler),
            pruner=_built(self.pruner) or optuna.pruners.NopPruner(),
            direction=self.direction,
            load_if_exists=True,
        )

    def sweep(self, arguments: list[str]) -> None:
        from optuna.trial import TrialState

        from ortflow.files import read_record
        from ortflow.run import pruning

        fixed, choices = [], {}
        for override in OverridesParser.create().parse_overrides(arguments):
            if override.is_sweep_override():  # a,b,c on the command line: one more categorical parameter
                choices[override.get_key_element()] = {
                    "type": "categorical",
                    "choices": list(override.sweep_iterator()),
                }
            else:
                fixed.append(override.input_line)
        params = {**self.params, **choices}
        if type(self.launcher).__name__ != "BasicLauncher":
            log.warning("pruning needs the in-process basic launcher; with %s trials run to the end", self.launcher)
        study = self._study()
        for stale in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
            study.tell(stale.number, state=TrialState.FAIL)  # cut short by an interrupted earlier run of the sweep
        objective = self.config.objective
        while sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials) < self.n_trials:
            trial = study.ask()
            values = {name: suggest(trial, name, spec) for name, spec in params.items()}
            overrides = [*fixed, *(f"{name}={value}" for name, value in values.items())]
            with pruning.active(trial):
                (result,) = self.launcher.launch([overrides], initial_job_idx=trial.number)
            record = read_record(Path(result.hydra_cfg.hydra.runtime.output_dir)) or {}
            status = record.get("status")
            if status == "pruned":
                study.tell(trial, state=TrialState.PRUNED)
            elif status == "completed":
                study.tell(trial, record["metrics"][objective])
            else:
                study.tell(trial, state=TrialState.FAIL)
            log.info("trial %d (%s): %s", trial.number, " ".join(overrides[len(fixed) :]), status)
        finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
        counts = {state.name.lower(): sum(t.state == state for t in study.trials) for state in TrialState}
        results: dict[str, Any] = {"name": "optuna", "trials": {k: v for k, v in counts.items() if v}}
        if finished:  # as Hydra's Optuna sweeper writes it, plus the trial counts by state
            results |= {"best_trial": study.best_trial.number, "best_params": study.best_params}
            results["best_value"] = study.best_value
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")
        if finished:
            log.info(
                "best trial %d: %s=%.6g with %s",
                study.best_trial.number,
                objective,
                study.best_value,
                study.best_params,
            )
