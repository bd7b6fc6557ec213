"""Whether a directory may take a run, decided before anything is written into it, and the lock that makes its
user the only one.

A run dir must be new, empty, or an ortflow run dir: a directory holding anything else (a user's own files) is
refused with the path named, so nothing of the user's is ever overwritten. A dir holding a run that trained is
refused unless the run resumes it (`trainer.resume`); one whose run stopped before its first step may be reused.
One process at a time owns a dir (ortflow/run/lock.py); a sweep's root is owned the same way by its sweep.

`claim` is the one check, used by the Python API, by the `ortflow` command before Hydra writes (the Hydra
callback `RunDirGuard`) and by each job of a sweep.
"""

import fnmatch
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ortflow import distributed
from ortflow.errors import RunDirError
from ortflow.run.launch import SHARED_RUN_DIR
from ortflow.run.lock import LOCK_FILE, RunDirLock
from ortflow.run.rundir import holds_a_run, never_trained

log = logging.getLogger(__name__)

# What ortflow (and Hydra for it) writes into a run dir; anything else makes the dir foreign.
OWN_NAMES = (
    LOCK_FILE,
    ".hydra",
    ".hydra-attempt-*",
    "ortflow.log",
    "run.json",
    "*.tmp",
    ".*.tmp-*",  # an atomic write a killed process left (removed on resume)
    "metrics.jsonl",
    "metrics.csv",  # logger.csv
    "mlflow.json",  # logger.mlflow: the run id a resume continues
    "tensorboard",
    "checkpoints",
    "onnx",
    "model.onnx",
    "tokenizer.json",  # a text run's tokenizer and data manifest (ortflow-predict finds them there)
    "data_manifest.json",
    "previous-attempt-*",
)


# What ortflow writes into a run dir before anything else: a non-empty dir without one of them is not a run dir.
MARKERS = (LOCK_FILE, ".hydra", "run.json", "ortflow.log", "checkpoints")


def foreign_entries(run_dir: Path) -> list[str]:
    """The names in `run_dir` that make it something else than an ortflow run dir (sorted): names ortflow does not
    write, or, in a dir holding none of ortflow's first files, everything (a user's own onnx/ folder, say)."""
    names = sorted(entry.name for entry in run_dir.iterdir())
    if names and not any(name in MARKERS for name in names):
        return names
    return [name for name in names if not any(fnmatch.fnmatchcase(name, pattern) for pattern in OWN_NAMES)]


def _make_dir(directory: Path, what: str) -> None:
    if directory.exists() and not directory.is_dir():
        raise RunDirError(f"{what} '{directory}' exists and is not a directory; name a new directory.")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(
            f"cannot create the {what} '{directory}' ({err.strerror}); name a directory you can write to, e.g. "
            "hydra.run.dir=outputs/NAME."
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise RunDirError(f"the {what} '{directory}' is not writable; name a directory you can write to.")


def claim(run_dir: Path, resume: str | None, *, sweep_job: bool = False) -> RunDirLock:
    """Check that `run_dir` may take this run and lock it for this process.

    Args:
        resume: trainer.resume (a dir holding a run that trained is only accepted when the run resumes; an earlier
            attempt's .hydra/, which Hydra is about to rewrite, is then kept as .hydra-attempt-N).
        sweep_job: the dir of a sweep's job, claimed when the job starts (Hydra has written its .hydra/ already):
            an earlier attempt of the job in it is moved aside by the run dir itself (RunDir.open).

    Raises:
        RunDirError: the path is not a usable directory, holds files ortflow did not write, is owned by another
            live process, or holds a run that trained and this one does not resume it.
    """
    _make_dir(run_dir, "run dir")
    foreign = foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise RunDirError(
            f"the run dir '{run_dir}' holds files that ortflow did not write ({shown}). A run dir must be new, empty "
            "or an ortflow run dir, so that nothing of yours is overwritten: name another directory (leave out "
            "hydra.run.dir for a fresh timestamped one)."
        )
    lock = RunDirLock.acquire(run_dir)
    try:
        if not sweep_job and holds_a_run(run_dir) and resume is None and not never_trained(run_dir):
            raise RunDirError(
                f"the run dir '{run_dir}' already holds a run, and ortflow never writes over one. Continue that run "
                "with trainer.resume=auto, or start a new one in another dir (leave out hydra.run.dir for a fresh "
                "timestamped one)."
            )
        if not sweep_job and (run_dir / ".hydra").is_dir():
            n = 1 + sum(1 for _ in run_dir.glob(".hydra-attempt-*"))
            shutil.copytree(run_dir / ".hydra", run_dir / f".hydra-attempt-{n}")
    except BaseException:
        lock.release(restore=True)
        raise
    return lock


# The locks this process holds for the run dirs and sweep dirs the command line started (released at exit).
_held: list[RunDirLock] = []


def release_held() -> None:
    """Give up the dirs the command line claimed (the run or sweep has ended; exiting would release them too)."""
    while _held:
        _held.pop().release()


def forget_held() -> None:
    """In a rank forked from the command: the dirs stay locked by the command, which holds them (the copies of its
    lock files' descriptors are closed here, without unlocking)."""
    while _held:
        _held.pop().forget()


def owns_its_dir() -> bool:
    """False for processes that share a run dir its owner already holds: the ranks ortflow starts under torchrun,
    and ranks other than 0 of a run started with torchrun by hand."""
    return not os.environ.get(SHARED_RUN_DIR) and not distributed.world_from_env().rank


def _refuse(err: RunDirError) -> None:
    print(f"ortflow: error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


class RunDirGuard(Callback):
    """The `ortflow` command's claim on its dirs, before Hydra writes anything: a single run's dir (on_run_start),
    a sweep's root (on_multirun_start; each job claims its own dir when it starts)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not owns_its_dir():
            return
        try:
            _held.append(claim(Path(config.hydra.run.dir), OmegaConf.select(config, "trainer.resume", default=None)))
        except RunDirError as err:
            _refuse(err)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        release_held()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        release_held()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            _make_dir(sweep_dir, "sweep dir")
            _held.append(RunDirLock.acquire(sweep_dir, "sweep dir"))
        except RunDirError as err:
            _refuse(err)
