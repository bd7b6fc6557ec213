"""Starting the processes of a multi-process run: ortflow runs torchrun's agent itself (`ortflow ... distributed=ddp`),
or the user runs `torchrun ... -m ortflow ...`. Either way all ranks share one run dir, and only rank 0 writes to it."""

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

log = logging.getLogger(__name__)

# Set for the ranks ortflow starts: the run dir is already the parent's (no guard against an existing run there).
SHARED_RUN_DIR = "ORTFLOW_SHARED_RUN_DIR"
# How ortflow started its ranks ("fork" or "spawn", start_method); unset under a torchrun started by hand.
RANK_START = "ORTFLOW_RANK_START"


def ranks_started_by() -> str:
    """How this process's rank was started: forked or spawned by ortflow's launch, or by a torchrun run by hand."""
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
    rank_main: Callable[[list[str], int], None],
) -> int:
    """Run this run's ranks under torchrun's agent, all in `run_dir`; return the launch's exit status (0: every rank
    of this node ended with 0).

    The agent runs in this process, with torchrun's own arguments and defaults (`torch.distributed.run`), and starts
    each rank as `rank_main(ARGS, agent pid)`, which runs `ortflow ARGS` (ortflow.cli.train.rank_main). The ranks
    are forked from this process, whose imports are done: a rank starts in a fraction of a second instead of
    importing torch, Hydra and ONNX Runtime again. Forking is safe only while no thread has started here since the
    command did (`start_method`); otherwise (a sweep whose earlier job trained in this process) the ranks start as
    fresh interpreters. SIGTERM and SIGINT reach the agent, which passes them to every rank (they checkpoint and
    stop)."""
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
    # One intra-op thread per rank unless set: measured 2-7x faster per step than oversubscribing the cores.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // d.nproc_per_node))
    method = start_method()
    environ = {SHARED_RUN_DIR: "1", RANK_START: method, "OMP_NUM_THREADS": threads}
    with _environ(environ), _signals_restored(), _no_agent_tracebacks():
        argv += [f"--start_method={method}", "-m", "ortflow", *rank_args]
        config, _, _ = torchrun.config_from_args(torchrun.parse_args(argv))
        try:
            elastic_launch(config, entrypoint=rank_main)(rank_args, os.getpid())
        except ChildFailedError as err:  # what torchrun prints: each failed rank, its exit code, its error
            stopped = all(f.exitcode == 128 + signal.SIGTERM for f in err.failures.values())
            if not stopped:  # ranks that stopped on SIGTERM after their checkpoint have not failed
                print(err.format_msg(), file=sys.stderr, flush=True)
            return 1
        except SignalException as err:  # the ranks were passed the signal and have ended
            return 128 + int(err.sigval)
        except Exception as err:  # the rendezvous failed (nodes that never came, an unreachable endpoint)
            log.error("the launch failed: %s", err)
            return 1
    return 0


def _threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux
        return None


_threads_at_start: list[int] = []  # the command's threads when it started (its imports done), Linux


def command_started() -> None:
    """Called first by the `ortflow` command: the threads it has now (numpy's OpenBLAS pool, which is fork-safe)
    are the ones a process may have for its ranks to be forked from it."""
    if (count := _threads()) is not None:
        _threads_at_start[:] = [count]


def start_method() -> str:
    """How the agent starts the ranks: `fork` while nothing has started a thread since the command started (no
    torch kernel has run in this process, no job of a sweep has trained in it), else `spawn`."""
    count = _threads()
    return "fork" if count is not None and _threads_at_start and count <= _threads_at_start[0] else "spawn"


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
