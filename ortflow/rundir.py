"""A run dir holds one run: a new run never writes into an existing one, and a resumed or re-run one keeps what
the earlier attempt wrote."""

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ortflow import distributed
from ortflow.launch import SHARED_RUN_DIR

log = logging.getLogger(__name__)

# What a run writes into its dir, besides Hydra's own .hydra/ and log file.
RUN_OUTPUTS = ("run.json", "metrics.jsonl", "tensorboard", "checkpoints", "onnx")


def holds_a_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (".hydra", "run.json", "checkpoints"))


def set_aside_previous_attempt(run_dir: Path) -> None:
    """A sweep job re-run in its old dir (after an interrupted sweep) keeps the earlier attempt's files, moved to
    previous-attempt-N/, so that nothing is lost and the new attempt's logs do not mix with the old."""
    if not (run_dir / "run.json").exists():
        return
    n = 1 + sum(1 for _ in run_dir.glob("previous-attempt-*"))
    target = run_dir / f"previous-attempt-{n}"
    target.mkdir()
    for name in RUN_OUTPUTS:
        if (run_dir / name).exists():
            (run_dir / name).rename(target / name)
    log.info("an earlier attempt's outputs in %s were moved to %s", run_dir, target)


class RunDirGuard(Callback):
    """Before Hydra writes anything into a single run's dir: refuse a dir that already holds a run unless the run
    resumes it (trainer.resume), and then keep a copy of the earlier attempt's .hydra/ (Hydra rewrites it)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = Path(config.hydra.run.dir)
        if os.environ.get(SHARED_RUN_DIR) or distributed.world_from_env().rank or not holds_a_run(run_dir):
            return  # ranks started by ortflow share its run dir; ranks other than 0 leave the dir to rank 0
        if OmegaConf.select(config, "trainer.resume", default=None) is None:
            print(
                f"ortflow: error: the run dir '{run_dir}' already holds a run, and ortflow never writes over one. "
                "Continue that run with trainer.resume=auto, or start a new one in another dir (leave out "
                "hydra.run.dir for a fresh timestamped one).",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(2)
        if (run_dir / ".hydra").is_dir():
            n = 1 + sum(1 for _ in run_dir.glob(".hydra-attempt-*"))
            shutil.copytree(run_dir / ".hydra", run_dir / f".hydra-attempt-{n}")
