"""`ortflow ...`: Hydra composes the config; runner.train does the work.

Single run: a user error prints one paragraph and exits with status 2. Multirun: a failing job is recorded
(run.json, the sweep summary) and the sweep goes on; a job that completed in an earlier run of the same sweep
(same sweep dir, same overrides) is skipped, so re-running an interrupted sweep finishes only what is left.
"""

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ortflow import preflight
from ortflow.config import register_configs
from ortflow.errors import OrtflowError
from ortflow.paths import config_dir
from ortflow.signals import Preempted

log = logging.getLogger("ortflow")
register_configs()


def completed_before(run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """The run.json of a job that already completed in this dir with the same overrides, else None."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    if record.get("status") == "completed" and record.get("overrides") == overrides:
        return record
    return None


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def _main(cfg: DictConfig) -> float:
    from ortflow.runner import train

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping and (record := completed_before(run_dir, overrides)):
        log.info("job %s already completed in this sweep dir (%s); skipped", hydra_cfg.job.num, run_dir)
        return record["metrics"][cfg.objective]
    try:
        metrics = train(cfg, run_dir, overrides)
    except Preempted as err:
        # A clean stop (exit status 0) that a scheduler can requeue; a sweep stops here too, resumable as a whole.
        print(
            f"ortflow: {err}. Continue with the same command plus trainer.resume=auto"
            + ("" if sweeping else f" hydra.run.dir={run_dir}")
            + ".",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(0)
    except OrtflowError as err:
        if os.environ.get("ORTFLOW_TRACEBACK"):
            traceback.print_exc()
        if sweeping:
            log.error("job %s failed: %s", hydra_cfg.job.num, err)
            return float("nan")
        print(f"ortflow: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception:
        if not sweeping:
            raise
        log.exception("job %s failed", hydra_cfg.job.num)  # recorded in run.json; the sweep goes on
        return float("nan")
    return metrics[cfg.objective]


def main() -> None:
    try:
        preflight.check(sys.argv[1:])
    except OrtflowError as err:
        print(f"ortflow: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    _main()


if __name__ == "__main__":
    main()
