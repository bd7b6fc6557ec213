"""`ortflow ...`: Hydra composes the config; runner.train does the work.

Single run: a user error prints one paragraph and exits with status 2; any other exception (a bug in ortflow, or
the user's own code raising) keeps its traceback, says where it was raised and exits with 1. Multirun: a failing
job is recorded (run.json, the sweep summary) and the sweep goes on; a job that completed in an earlier run of the
same sweep (same sweep dir, same overrides) is skipped, so re-running an interrupted sweep finishes only what is
left.
"""

import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from threadpoolctl import threadpool_limits
from torch.distributed.elastic.multiprocessing.errors import record as record_errors

from ortflow import distributed, preflight
from ortflow.api import register_configs
from ortflow.errors import OrtflowError, origin, root_reason
from ortflow.files import read_record
from ortflow.paths import config_dir
from ortflow.report.summary import print_summary
from ortflow.run import launch, placement
from ortflow.run.guard import claim, forget_held, owns_its_dir, release_held
from ortflow.run.signals import Interrupted, Preempted, hand_over_preemption, stop_was_asked
from ortflow.validate import validate

log = logging.getLogger("ortflow")
register_configs()


def completed_before(run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """The run.json of a job that already completed in this dir with the same overrides, else None."""
    record = read_record(run_dir)
    if record and record.get("status") == "completed" and record.get("overrides") == overrides:
        return record
    return None


def _user_error(err: OrtflowError, sweeping: bool) -> float:
    """A sweep records the failed job and goes on (nan); a single run prints one paragraph and exits with 2."""
    if sweeping:
        log.error("job %s failed: %s", HydraConfig.get().job.num, err)
        return float("nan")
    print(f"ortflow: error{_rank()}: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


def _unexpected(err: Exception, run_dir: Path) -> NoReturn:
    """An exception that is no user error: its traceback, where it was raised (ortflow's own code: a bug in
    ortflow), the run dir whose run.json records it; exit status 1."""
    traceback.print_exc()
    where = origin(err)
    what = f"{type(err).__name__}: {root_reason(err) if str(err) else type(err).__name__}"
    if where.kind == "ortflow":
        said = f"this is a bug in ortflow, not in your model, data or config ({what}, raised in {where})"
    elif where.kind == "user":
        said = f"your code raised {what} (in {where})"
    else:
        said = f"{what} was raised inside a library ({where}); with a right model and config, a bug in ortflow"
    print(
        f"ortflow: {said}. The traceback above shows where; run.json in {run_dir} records the failed run. A bug in "
        "ortflow: please report it with that traceback.",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(1)


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def _main(cfg: DictConfig) -> float:
    from ortflow.run.runner import train

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping and (record := completed_before(run_dir, overrides)):
        log.info("job %s already completed in this sweep dir (%s); skipped", hydra_cfg.job.num, run_dir)
        return record["metrics"][cfg.objective]
    continued = _continue_rerun(cfg, sweeping)
    if launch.needs_launch(cfg):
        launch.start_rank_server(cfg, rank_main)  # its imports overlap the checks and the rendezvous
        try:
            validate(cfg)  # the wrapper order and launch settings, before any process starts
        except OrtflowError as err:
            return _user_error(err, sweeping)
        return _launch(cfg, run_dir, overrides + continued, list(hydra_cfg.overrides.hydra), sweeping)
    started = time.monotonic()

    def summary() -> None:  # the closing table of a single run, on rank 0
        if not sweeping and not distributed.world_from_env().rank:
            print_summary(run_dir, time.monotonic() - started)

    lock = None
    try:
        if sweeping and owns_its_dir():  # a single run's dir was claimed before Hydra wrote (RunDirGuard)
            lock = claim(run_dir, cfg.trainer.resume, sweep_job=True)
        metrics = train(cfg, run_dir, overrides, Path(hydra_cfg.sweep.dir) if sweeping else None).metrics
    except Preempted as err:
        summary()
        if lock is not None:
            lock.release()
        _stop_preempted(err, run_dir, sweeping)
    except Interrupted as err:
        summary()
        print(f"ortflow: {err}; run.json in {run_dir} records it.", file=sys.stderr, flush=True)
        sys.exit(err.exit_status)
    except OrtflowError as err:
        if os.environ.get("ORTFLOW_TRACEBACK"):
            traceback.print_exc()
        summary()
        return _user_error(err, sweeping)
    except Exception as err:
        if sweeping:
            log.exception("job %s failed", hydra_cfg.job.num)  # recorded in run.json; the sweep goes on
            return float("nan")
        summary()
        _unexpected(err, run_dir)
    finally:
        if lock is not None:
            lock.release()
    summary()
    return metrics[cfg.objective]


def _continue_rerun(cfg: DictConfig, sweeping: bool) -> list[str]:
    """A sweep job that its scheduler runs again (Ray retry, SLURM requeue) continues its checkpoint: trainer.resume
    is set to auto in `cfg`, and the override that says so is returned (none for any other job)."""
    if sweeping and cfg.trainer.resume is None and (why := placement.rerun()):
        log.info("%s: continuing from its latest checkpoint (trainer.resume=auto)", why)
        cfg.trainer.resume = "auto"
        return ["trainer.resume=auto"]
    return []


def _stop_preempted(err: Preempted, run_dir: Path, sweeping: bool) -> NoReturn:
    """A run stopped by preemption with its checkpoint written: a scheduler that requeues it gets it, else rank 0
    says how to continue, and the process exits with status 0."""
    hand_over_preemption()  # submitit's requeue (SLURM jobs it runs) exits here
    # A clean stop (exit status 0) that a scheduler can requeue; a sweep stops here too, resumable as a whole.
    if not distributed.world_from_env().rank:
        print(
            f"ortflow: {err}. Continue with the same command plus trainer.resume=auto"
            + ("" if sweeping else f" hydra.run.dir={run_dir}")
            + ".",
            file=sys.stderr,
            flush=True,
        )
    sys.exit(0)


def _rank() -> str:
    world = distributed.world_from_env()
    return f" (rank {world.rank} of {world.size})" if world.size > 1 else ""


def _launch(cfg: DictConfig, run_dir: Path, overrides: list[str], hydra_overrides: list[str], sweeping: bool) -> float:
    """Run this (validated) run or sweep job under torchrun; its rank 0 writes run.json, read back here."""
    started = time.monotonic()
    status = launch.run_torchrun(cfg, run_dir, overrides, hydra_overrides, rank_main)
    if status and (reason := launch.rendezvous_timed_out(cfg, run_dir, time.monotonic() - started)):
        print(f"ortflow: error: {reason}", file=sys.stderr, flush=True)
    if record := completed_before(run_dir, overrides):
        return record["metrics"][cfg.objective]
    if status == 0:  # this node ran no rank 0 (multi-node): rank 0's run dir, on node 0, holds the results
        log.info("node %d done; the run's results are in node 0's run dir", cfg.distributed.node_rank)
        return float("nan")
    if sweeping:
        log.error("job in %s failed under torchrun (exit status %s)", run_dir, status)
        return float("nan")
    stopped = (read_record(run_dir) or {}).get("status") == "preempted"
    sys.exit(0 if stopped else status or 1)


@record_errors
def main() -> None:
    try:
        preflight.check(sys.argv[1:])
        sys.argv += launch.rank_overrides(sys.argv[1:])
    except OrtflowError as err:
        print(f"ortflow: error{_rank()}: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        _main()
    except KeyboardInterrupt:  # a second Ctrl-C while the first one's stop was being recorded
        print("ortflow: interrupted (Ctrl-C).", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    finally:
        release_held()  # the dirs this command claimed (exiting releases them too; a caller in-process goes on)


def rank_main(args: list[str]) -> None:
    """One rank, in the process the launch's rank fork server forked for it (ortflow.run.launch.run_rank): the
    `ortflow ARGS` command, as torchrun would start it.

    It takes the default signal handlers back, leaves any run dir's lock to its owner and reads its thread count from
    OMP_NUM_THREADS again, for torch and every thread pool threadpoolctl finds (the BLAS and OpenMP libraries). It
    ends with the command's status; a rank stopped by SIGTERM (checkpoint written) ends with 143, which the launching
    command reads as a stop: the run's record says "preempted"."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    forget_held()
    GlobalHydra.instance().clear()
    threads = int(os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(threads)
    threadpool_limits(threads)  # every pool, numpy's OpenBLAS too (the fork server kept it to one thread)
    sys.argv = [sys.argv[0], *args]
    try:
        main()
    except SystemExit as end:
        if end.code:
            raise
    if stop_was_asked():
        # Stopped by SIGTERM with its checkpoint written. The agent that sent it waits for the rank to exit, which
        # a returning rank would not do before the agent read its result: exit now, with the signal's status.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
