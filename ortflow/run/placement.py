"""Where a sweep job runs when a launcher placed it on another machine or process: the Ray node and host (set by
ortflow's Ray launcher, hydra_plugins/ortflow_ray, in ORTFLOW_PLACEMENT) or the SLURM job (SLURM's own variables).
run.json records it as `placement`; a job the scheduler runs again (a Ray retry after its node was lost, a SLURM
requeue after preemption) continues from its latest checkpoint."""

import json
import os
from typing import Any

# Set by a launcher in the job's process: a JSON object (launcher, node_id, host, attempt, cpus, threads, ...).
PLACEMENT = "ORTFLOW_PLACEMENT"
# SLURM's variables that say where a job runs and how often it was requeued.
_SLURM = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "node_id": "SLURM_NODEID",
    "nodes": "SLURM_JOB_NODELIST",
    "host": "SLURMD_NODENAME",
    "restart_count": "SLURM_RESTART_COUNT",
}


def placement() -> dict[str, Any] | None:
    """The job's placement, or None for a run started where the command runs."""
    if raw := os.environ.get(PLACEMENT):
        return json.loads(raw)
    if "SLURM_JOB_ID" in os.environ:
        found = {key: os.environ[name] for key, name in _SLURM.items() if name in os.environ}
        return {"launcher": "slurm", **found}
    return None


def rerun() -> str | None:
    """Why this job is a run its scheduler started again (None when it is not): it then continues from its latest
    checkpoint instead of starting over."""
    where = placement() or {}
    if where.get("launcher") == "slurm" and int(where.get("restart_count") or 0) > 0:
        return f"SLURM requeued job {where['job_id']} (restart {where['restart_count']})"
    if int(where.get("attempt") or 1) > 1:
        return f"the {where.get('launcher')} launcher ran this job again (attempt {where['attempt']})"
    return None
