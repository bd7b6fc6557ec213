"""A rank that only meets the others: what the launch tests start instead of `ortflow ...` (ortflow.run.launch),
so that a launch costs the fork, the rendezvous and one collective, not a training run."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def meet(args: list[str]) -> None:
    """Join the gloo group torchrun's agent set up, sum the ranks, and write what this rank saw into args[0] as
    rank-R.json: the threads of the process it was forked from, its parent, the sum, the variables it was given."""
    from ortflow.run import rank_server

    dist.init_process_group("gloo")
    try:
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        report = {
            "rank": dist.get_rank(),
            "threads_at_fork": rank_server.threads_at_fork(),
            "parent": os.getppid(),
            "server": rank_server.SERVER_PID,
            "sum": total.item(),
            "launch": os.environ.get("ORTFLOW_TEST_LAUNCH"),
            "master_port": os.environ.get("MASTER_PORT"),
            "openblas": os.environ.get("OPENBLAS_NUM_THREADS"),
        }
        Path(args[0], f"rank-{dist.get_rank()}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def exit_with(args: list[str]) -> None:
    """End with the exit status args[0], as a rank whose command failed does (2: a user's error)."""
    raise SystemExit(int(args[0]))
