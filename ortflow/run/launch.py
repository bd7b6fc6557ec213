"""Starting the processes of a multi-process run: ortflow runs torchrun itself (`ortflow ... distributed=ddp`), or
the user runs `torchrun ... -m ortflow ...`. Either way all ranks share one run dir, and only rank 0 writes to it."""

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from ortflow import distributed
from ortflow.errors import OrtflowError

# Set for the ranks ortflow starts: the run dir is already the parent's (no guard against an existing run there).
SHARED_RUN_DIR = "ORTFLOW_SHARED_RUN_DIR"


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


def end_with_parent() -> None:
    """In a child process before it runs (Popen's preexec_fn), Linux: the kernel sends it SIGTERM when the process
    that started it dies, by SIGKILL too, so torchrun (which then stops its ranks) is never left orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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


def run_torchrun(cfg: DictConfig, run_dir: Path, overrides: list[str], hydra_overrides: list[str]) -> int:
    """Run this run's ranks under torchrun, all in `run_dir`; return torchrun's exit status.

    SIGTERM and SIGINT are passed on to torchrun, which passes them to every rank (they checkpoint and stop)."""
    d = cfg.distributed
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={d.nproc_per_node}"]
    if d.nnodes == 1:
        command.append("--standalone")
    else:
        # Static rendezvous: ranks follow node_rank (node 0 holds rank 0, which writes the run dir). c10d
        # rendezvous would assign ranks in arrival order.
        host, _, port = d.rdzv_endpoint.rpartition(":")
        command += [
            f"--nnodes={d.nnodes}",
            f"--node_rank={d.node_rank}",
            f"--master_addr={host}",
            f"--master_port={port}",
            f"--rdzv_conf=timeout={d.rdzv_timeout_s}",  # nodes that never come: fail instead of waiting silently
        ]
    passed = [o for o in hydra_overrides if o.startswith("hydra.searchpath=")]
    command += ["-m", "ortflow", *overrides, *passed, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, SHARED_RUN_DIR: "1"}
    # One intra-op thread per rank unless set: measured 2-7x faster per step than oversubscribing the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // d.nproc_per_node)))
    proc = subprocess.Popen(command, env=env, preexec_fn=end_with_parent)
    previous = {sig: signal.signal(sig, lambda s, _f: proc.send_signal(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
