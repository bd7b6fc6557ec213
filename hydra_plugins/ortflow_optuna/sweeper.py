"""An Optuna sweeper for Hydra, on Optuna's public ask-and-tell API, whose trials can be pruned.

Hydra's own Optuna sweeper (hydra-optuna-sweeper) requires optuna < 3 and only sees a job's final return value,
so it cannot prune. Here each trial is one Hydra job, run by whichever launcher the sweep uses: the basic one in this
process, or Ray or SLURM in other processes and on other machines, `n_jobs` trials at a time. A job reaches its trial
through the study's storage (ortflow/run/pruning.py: the trial is named in the job's environment through
hydra.job.env_set); while it trains, its evaluations are reported to the trial and the study's pruner may stop it
early, which the job records as status "pruned". The study lives in an SQLite file in the sweep dir (or `storage`,
which must be reachable from every node: SQLite only from this host), so running the same command again with the
same hydra.sweep.dir resumes an interrupted sweep: finished trials (completed or pruned) count toward n_trials, a
trial cut short by the interruption is marked failed and replaced.
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
    n_jobs: int = 1  # trials launched together (run side by side by a launcher that runs jobs in parallel: Ray, SLURM)
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
        n_jobs: int,
        study_name: str,
        storage: str | None,
        sampler: Any,
        pruner: Any,
        params: dict[str, Any],
    ) -> None:
        self.direction, self.n_trials, self.n_jobs, self.study_name = direction, n_trials, n_jobs, study_name
        self.storage, self.sampler, self.pruner = storage, sampler, pruner
        self.params = {k: OmegaConf.to_container(v) if isinstance(v, DictConfig) else v for k, v in params.items()}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.sweep_dir = Path(config.hydra.sweep.dir)
        pruner = OmegaConf.select(config, "hydra.sweeper.pruner")
        # What a job builds the study's pruner from (the pruner is not kept in the storage).
        self.pruner_config = OmegaConf.to_container(pruner, resolve=True) if pruner is not None else None
        self.storage_url = self.storage or f"sqlite:///{(self.sweep_dir / 'optuna.db').resolve()}"

    def _study(self) -> Any:
        import optuna

        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        return optuna.create_study(
            study_name=self.study_name,
            storage=self.storage_url,
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
        study = self._study()
        for stale in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
            study.tell(stale.number, state=TrialState.FAIL)  # cut short by an interrupted earlier run of the sweep
        objective = self.config.objective

        def ended() -> int:
            return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)

        while (left := self.n_trials - ended()) > 0:
            trials = [study.ask() for _ in range(min(self.n_jobs, left))]
            batch = []
            for trial in trials:
                values = {name: suggest(trial, name, spec) for name, spec in params.items()}
                # The job reaches its trial through the storage, in whichever process or machine it runs.
                # Optuna's Trial(study, trial_id) is how a process other than the asking one reports to a trial.
                spec = pruning.trial_env(
                    self.storage_url, self.study_name, trial._trial_id, trial.number, self.pruner_config
                )
                env = "'" + spec.replace("\\", "\\\\").replace("'", "\\'") + "'"
                batch.append(
                    [
                        *fixed,
                        *(f"{name}={value}" for name, value in values.items()),
                        f"+hydra.job.env_set.{pruning.TRIAL}={env}",
                    ]
                )
            results = self.launcher.launch(batch, initial_job_idx=trials[0].number)
            for trial, overrides, result in zip(trials, batch, results, strict=True):
                record = read_record(Path(result.hydra_cfg.hydra.runtime.output_dir)) or {}
                status = record.get("status")
                if status == "pruned":
                    study.tell(trial, state=TrialState.PRUNED)
                elif status == "completed":
                    study.tell(trial, record["metrics"][objective])
                else:
                    study.tell(trial, state=TrialState.FAIL)
                log.info("trial %d (%s): %s", trial.number, " ".join(overrides[len(fixed) : -1]), status)
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
