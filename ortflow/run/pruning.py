"""The Optuna trial a sweep job belongs to, reached through the study's storage, and the loop's hook that reports
evaluations to it: a trial its pruner finds unpromising stops after that evaluation and the run ends with status
"pruned".

The sweeper (hydra_plugins/ortflow_optuna) names the trial in the job's environment (ORTFLOW_OPTUNA_TRIAL, set with
Hydra's hydra.job.env_set, which every launcher applies where the job runs), so a job in another process or on
another machine (Ray, SLURM) reports to the same study as one run in the sweep's own process. The storage must be
reachable from the job: an SQLite file only from the host the sweep runs on (SQLite's locking is not safe across
machines, even on a shared file system), which is checked here."""

import json
import os
import socket
from collections.abc import Callable
from typing import Any

from ortflow.errors import OrtflowError

# {"storage": URL, "study": name, "trial_id": id, "number": n, "host": the sweep's host, "pruner": its config}
TRIAL = "ORTFLOW_OPTUNA_TRIAL"


def trial_env(storage: str, study: str, trial_id: int, number: int, pruner: dict[str, Any] | None) -> str:
    """The value of TRIAL for one trial, written by the sweep. The pruner is not kept in the storage: the job builds
    the sweep's own from its config (`_target_` and arguments)."""
    spec = {"storage": storage, "study": study, "trial_id": trial_id, "number": number, "host": socket.gethostname()}
    return json.dumps(spec | {"pruner": pruner})


def _sqlite_file(storage: str) -> str | None:
    return storage.split(":///", 1)[1] if storage.startswith("sqlite:///") else None


def check_reachable(spec: dict[str, Any]) -> None:
    """Refuse a storage this job cannot share with the sweep (an SQLite file on another host, or a missing one).

    Raises:
        OrtflowError: naming the storage, the hosts and the fix.
    """
    storage = spec["storage"]
    path = _sqlite_file(storage)
    if path is None:
        return
    here = socket.gethostname()
    if spec["host"] != here:
        raise OrtflowError(
            f"the Optuna study's storage hydra.sweeper.storage={storage} is an SQLite file on the sweep's host "
            f"{spec['host']}, and this trial runs on {here}: SQLite works only on one host (its locking is not safe "
            "across machines, even on a shared file system). Give the sweep a storage every node reaches, e.g. "
            "hydra.sweeper.storage=postgresql://USER:PASSWORD@HOST/DB (or mysql://...)."
        )
    if not os.path.isfile(path):
        raise OrtflowError(
            f"the Optuna study's SQLite file {path} (hydra.sweeper.storage) does not exist where this trial runs: "
            "run the sweep and its jobs on one file system, or give it a server storage (postgresql://, mysql://)."
        )


def reporter(metric: str) -> Callable[[int, dict[str, float]], bool] | None:
    """For a job of a pruning sweep: a callback reporting `metric` at each evaluation, returning True when the
    trial should stop. None outside one (or when `metric` is not measured at evaluations).

    Raises:
        OrtflowError: the study's storage cannot be shared with this job (check_reachable).
    """
    raw = os.environ.get(TRIAL)
    if raw is None or not metric.startswith("eval/"):
        return None
    spec = json.loads(raw)
    check_reachable(spec)
    import optuna
    from hydra.utils import instantiate

    pruner = instantiate(spec["pruner"]) if spec["pruner"] else optuna.pruners.NopPruner()
    study = optuna.load_study(study_name=spec["study"], storage=spec["storage"], pruner=pruner)
    trial = optuna.trial.Trial(study, spec["trial_id"])

    def report(step: int, evaluated: dict[str, float]) -> bool:
        if metric not in evaluated:
            return False
        trial.report(evaluated[metric], step)
        return trial.should_prune()

    return report
