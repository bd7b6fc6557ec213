"""Starting the processes of a multi-process run: ortflow runs torchrun's agent itself (`ortflow ... distributed=ddp`)
and forks the ranks from a fork server with one thread (ortflow/run/rank_server.py), or the user runs
`torchrun ... -m ortflow ...`. Either way all ranks share one run dir, and only rank 0 writes to it."""

import contextlib
import ctypes
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from omegaconf import DictConfig

from ortflow import distributed
from ortflow.errors import OrtflowError
from ortflow.files import read_record, write_json_atomic
from ortflow.run import rank_server
from ortflow.run.metadata import now

log = logging.getLogger(__name__)

# Set for the ranks ortflow starts: the run dir is already the parent's (no guard against an existing run there).
SHARED_RUN_DIR = "ORTFLOW_SHARED_RUN_DIR"
# How ortflow started its ranks ("forkserver"); unset under a torchrun started by hand.
RANK_START = "ORTFLOW_RANK_START"
START_METHOD = "forkserver"  # multiprocessing's fork server, which preloads ortflow/run/rank_server.py
USER_ERROR = 2  # a rank's exit status for an error the user can fix (one paragraph, as the command's own)


def ranks_started_by() -> str:
    """How this process's rank was started: forked by ortflow's rank fork server, or by a torchrun run by hand."""
    return os.environ.get(RANK_START, "torchrun")


def rank_overrides(args: list[str]) -> list[str]:
    """Extra command-line overrides for a process started by torchrun (empty otherwise).

    All ranks must write into one run dir: without hydra.run.dir each would compose its own timestamp, so the
    dir is named after torchrun's run id, which every rank shares. Ranks other than 0 leave Hydra's .hydra/ and
    log file to rank 0."""
    world = distributed.world_from_env()
    if not distributed.under_torchrun() or world.size == 1:
        return []
    if any(a in ("-m", "--multirun") for a in args):
        raise OrtflowError(
            "a sweep (-m) cannot run under torchrun (every rank would run its own sweep). Run the sweep with "
            "`ortflow -m ... distributed=ddp`: ortflow then starts torchrun for each job."
        )
    extra = []
    if not any(a.startswith("hydra.run.dir=") for a in args):
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id == "none":
            raise OrtflowError(
                "under torchrun without --standalone or --rdzv_id, the ranks cannot agree on a run dir: pass "
                "--rdzv_id=NAME to torchrun, or hydra.run.dir=DIR to ortflow."
            )
        extra.append(f"hydra.run.dir=outputs/${{now:%Y-%m-%d}}/torchrun-{run_id}")
    if world.rank:
        extra += ["hydra.output_subdir=null", "hydra.job_logging.root.handlers=[console]"]
    return extra


def needs_launch(cfg: DictConfig) -> bool:
    return distributed.processes(cfg.distributed) > 1 and not distributed.under_torchrun()


def end_with_parent(parent: int) -> bool:
    """In a process `parent` started (a rank, a benchmark measurement), Linux: the kernel sends it SIGTERM when its
    parent dies, by SIGKILL too, so it is never left orphaned (a rank checkpoints and stops as on any SIGTERM).
    Returns whether `parent` is still alive: False when it died before the signal was set up."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    return os.getppid() == parent


def rendezvous_timed_out(cfg: DictConfig, run_dir: Path, elapsed_s: float) -> str | None:
    """The reason a multi-node launch that ended without a run record most likely failed: the nodes never all
    joined the rendezvous within distributed.rdzv_timeout_s (None when that cannot be what happened)."""
    d = cfg.distributed
    if d.nnodes == 1 or elapsed_s < d.rdzv_timeout_s or (run_dir / "run.json").exists():
        return None
    return (
        f"the {d.nnodes} nodes (distributed.nnodes) did not all join the rendezvous at {d.rdzv_endpoint} within "
        f"distributed.rdzv_timeout_s={d.rdzv_timeout_s}: start the same command on every node, each with its own "
        "distributed.node_rank and the same distributed.rdzv_endpoint (node 0's address, reachable from all), or "
        "raise the timeout."
    )


def run_torchrun(
    cfg: DictConfig,
    run_dir: Path,
    overrides: list[str],
    hydra_overrides: list[str],
    rank_main: Callable[[list[str]], None],
) -> int:
    """Run this run's ranks under torchrun's agent, all in `run_dir`; return the launch's exit status (0: every rank
    of this node ended with 0).

    The agent runs in this process, with torchrun's own arguments and defaults (`torch.distributed.run`), and starts
    each rank as `rank_main(ARGS)`, which runs `ortflow ARGS` (ortflow.cli.train.rank_main). The ranks are forked by
    the rank fork server (`start_rank_server`, ortflow/run/rank_server.py), a process with one thread whose imports
    are done: a rank starts in a fraction of a second instead of importing torch, Hydra and ONNX Runtime again, and
    is never forked from this process, whose agent runs threads. SIGTERM and SIGINT reach the agent, which passes
    them to every rank (they checkpoint and stop)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    d = cfg.distributed
    argv = [f"--nproc_per_node={d.nproc_per_node}"]
    if d.nnodes == 1:  # what torchrun --standalone sets up: a rendezvous on a free local port
        argv += ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", f"--rdzv_id={uuid.uuid4()}"]
    else:
        # Static rendezvous: ranks follow node_rank (node 0 holds rank 0, which writes the run dir). c10d
        # rendezvous would assign ranks in arrival order.
        host, _, port = d.rdzv_endpoint.rpartition(":")
        argv += [
            f"--nnodes={d.nnodes}",
            f"--node_rank={d.node_rank}",
            f"--master_addr={host}",
            f"--master_port={port}",
            f"--rdzv_conf=timeout={d.rdzv_timeout_s}",  # nodes that never come: fail instead of waiting silently
        ]
    passed = [o for o in hydra_overrides if o.startswith("hydra.searchpath=")]
    rank_args = [*overrides, *passed, f"hydra.run.dir={run_dir}"]
    start_rank_server(cfg, rank_main)  # a no-op when the command started it as soon as it knew
    with _environ(rank_environ(cfg)), _signals_restored(), _no_agent_tracebacks():
        argv += [f"--start_method={START_METHOD}", "-m", "ortflow", *rank_args]
        config, _, _ = torchrun.config_from_args(torchrun.parse_args(argv))
        try:
            elastic_launch(config, entrypoint=run_rank)(rank_main, rank_args, dict(os.environ))
        except ChildFailedError as err:  # what torchrun prints: each failed rank, its exit code, its error
            codes = {f.exitcode for f in err.failures.values()}
            if codes <= {128 + signal.SIGTERM}:  # ranks that stopped on SIGTERM after their checkpoint have not failed
                return 1
            record_rank_failure(run_dir, {rank: f.exitcode for rank, f in err.failures.items()})
            if USER_ERROR in codes and codes <= {USER_ERROR, 128 + signal.SIGTERM, -signal.SIGTERM}:
                return USER_ERROR  # a user's error (its paragraph printed by the rank), the others stopped with it
            print(err.format_msg(), file=sys.stderr, flush=True)
            return 1
        except SignalException as err:  # the ranks were passed the signal and have ended
            return 128 + int(err.sigval)
        except Exception as err:  # the rendezvous failed (nodes that never came, an unreachable endpoint)
            log.error("the launch failed: %s", err)
            return 1
    return 0


def record_rank_failure(run_dir: Path, exit_codes: dict[int, int]) -> None:
    """A rank failed and torchrun's agent stopped the others (SIGTERM): rank 0's run.json then says how rank 0
    stopped, "interrupted" (outside its steps), "preempted" (a checkpoint after its step) or still "running" (ended
    inside a collective, where its record cannot be written). The run failed: recorded so, naming the ranks that
    failed (a checkpoint rank 0 wrote stays named in the record). A record that already says "failed" is kept."""
    record = read_record(run_dir)
    if record is None or record.get("status") not in ("running", "interrupted", "preempted"):
        return
    failed = ", ".join(f"rank {rank} exited with status {code}" for rank, code in sorted(exit_codes.items()))
    record |= {"status": "failed", "finished": now(), "error": f"a rank failed: {failed}"}
    try:
        write_json_atomic(run_dir / "run.json", record)
    except OrtflowError as err:
        log.error("run.json could not record that a rank failed: %s", err)


def rank_environ(cfg: DictConfig) -> dict[str, str]:
    """What the launch adds to the ranks' environment: the shared run dir, how they started, their intra-op threads
    (one core each unless OMP_NUM_THREADS is set: measured 2-7x faster per step than oversubscribing the cores)."""
    per_rank = max(1, (os.cpu_count() or 1) // cfg.distributed.nproc_per_node)
    threads = os.environ.get("OMP_NUM_THREADS") or str(per_rank)
    return {SHARED_RUN_DIR: "1", RANK_START: START_METHOD, "OMP_NUM_THREADS": threads}


def start_rank_server(cfg: DictConfig, rank_main: Callable[[list[str]], None]) -> None:
    """Start the process the ranks are forked from, unless it runs (ortflow/run/rank_server.py): a fresh interpreter
    that imports the module of `rank_main` and the runner, then waits. Returns at once: its imports (a few seconds)
    overlap the command's own work until the agent asks for the ranks. It starts with the launch's environment; each
    rank gets the command's back at the launch (`run_rank`). The server lives as long as this process (a sweep's
    later jobs reuse it) and ends with it, by kill -9 too (it reads end-of-file on a pipe from this process)."""
    with _environ(rank_environ(cfg)):
        rank_server.start([rank_main.__module__, "ortflow.run.runner"])


def run_rank(rank_main: Callable[[list[str]], None], args: list[str], environ: dict[str, str]) -> None:
    """One rank, in the process the rank fork server forked for it: checked to come from a process with one thread,
    set to end with that server (which ends with the command), given the command's environment (`environ`) plus what
    the agent set for this rank, then `rank_main(args)`.

    Raises:
        RuntimeError: the server had another thread when it forked this rank (a bug in ortflow).
    """
    rank_server.check_forked_alone()
    if not end_with_parent(rank_server.SERVER_PID):  # the server (so the command) died before this rank started
        os._exit(128 + signal.SIGTERM)
    merged = rank_server.rank_environ(environ)
    os.environ.clear()
    os.environ.update(merged)
    rank_main(args)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """`values` set in os.environ (the ranks inherit it) for the launch, the previous environment back after."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """The agent installs its own handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT; this process's are put back."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _drop_traceback(record: logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


@contextlib.contextmanager
def _no_agent_tracebacks() -> Iterator[None]:
    """The agent logs a failed rank with its own traceback (of where it noticed the exit, not of the rank's error),
    above the summary that names the rank: the line stays, the traceback goes."""
    agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent.addFilter(_drop_traceback)
    try:
        yield
    finally:
        agent.removeFilter(_drop_traceback)
