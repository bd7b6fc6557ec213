"""Run metadata: what ran, where, from which code, and how it ended. Written to <run dir>/run.json at the start
(status "running"), and again when the run completes or fails, so even a crashed run leaves a record."""

import os
import platform
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from ortflow import allocator
from ortflow.run.placement import placement


def git_state(cwd: Path) -> dict[str, Any] | None:
    """Commit and dirtiness of the git checkout containing `cwd`, or None outside a checkout (or without git)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain")),
            "root": git("rev-parse", "--show-toplevel"),
        }
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def thread_pools() -> dict[str, int]:
    """The threads of every BLAS and OpenMP pool loaded in this process (threadpoolctl), by library file."""
    from threadpoolctl import threadpool_info

    return {Path(pool["filepath"]).name: int(pool["num_threads"]) for pool in threadpool_info()}


def host() -> dict[str, Any]:
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "hostname": platform.node(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "thread_pools": thread_pools(),
        "malloc": allocator.applied(),
        "gpus": gpus,
    }


def versions() -> dict[str, str]:
    """The versions a run records, from the installed distributions' metadata (an eager run imports neither onnx nor
    onnxruntime)."""
    import hydra

    from ortflow.accel.compat.versions import installed_versions

    return {"python": platform.python_version(), **installed_versions(), "hydra": hydra.__version__}


def now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def start_record(config: dict[str, Any], overrides: list[str], seed: int) -> dict[str, Any]:
    """Everything known before training starts (and, when a run goes ahead on versions outside what the ORT
    engines were tested with, which ones)."""
    from ortflow.accel.compat import cpp_patches, torch_patches
    from ortflow.accel.compat.versions import untested_versions

    untested = untested_versions()
    # The compatibility patches the ORT engines apply on this torch (accel/compat/torch_patches.py, cpp_patches.py).
    patches = [patch.name for patch in [*torch_patches.needed(), *cpp_patches.needed()]]
    where = placement()  # a job a launcher placed on another node or process
    return (
        ({"untested_versions": untested} if untested else {})
        | ({"placement": where} if where else {})
        | {
            "status": "running",
            "started": now(),
            "command": [sys.executable, *sys.argv],
            "overrides": overrides,
            "cwd": os.getcwd(),
            "git": git_state(Path.cwd()),
            "seed": seed,
            "host": host(),
            "versions": versions(),
            "torch_patches": patches,
            "config": config,
        }
    )
