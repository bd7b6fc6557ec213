"""A Hydra launcher that runs a sweep's jobs as Ray tasks, on a running cluster or on a local Ray it starts.

Written on Ray's public API rather than configuring hydra-ray-launcher 1.2.2, which cannot do what a sweep here
needs: it always passes object_store_memory to ray.init (refused when connecting to a cluster by address), collects
with one ray.get per job (one lost task raises out of the whole multirun), and leaves each task Ray's 1 CPU, one
thread and a reused worker process.

Here each job is one Ray task in a fresh worker process (max_calls=1) with `cpus_per_job` CPUs and `threads` intra-op
threads, both recorded in the job's run.json (`placement`) with the Ray node id and host it ran on. Results are
collected as jobs finish. A job whose worker or node is lost is run again (up to `max_retries` times) on a live node,
where it continues from its latest checkpoint; when no live node offers the custom resources it was pinned with, the
retry runs without them. A job that cannot be run again is recorded as failed in its run.json, and the sweep returns
every other job's result. Job dirs are written by the jobs, on their nodes: the sweep dir must be on a file system
every node shares, where the sweep summary reads them."""

import json
import logging
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class RayLauncherConf:
    _target_: str = "hydra_plugins.ortflow_ray.launcher.RayLauncher"
    # host:port of a running cluster's head (`ray start --head`), or "auto" (RAY_ADDRESS or the cluster started on
    # this machine); null: start a local Ray for this sweep (with `local`).
    address: str | None = None
    cpus_per_job: float = 1  # Ray CPUs each job reserves
    threads: int | None = None  # intra-op threads of each job (OMP_NUM_THREADS); null: cpus_per_job, rounded up
    # Custom resources each job needs (`ray start --resources`): pins jobs to the nodes that offer them. May differ per
    # job (hydra.launcher.resources in a file the sweep chooses per job).
    resources: dict[str, float] = field(default_factory=dict)
    max_retries: int = 2  # runs again of a job whose worker or node was lost; 0: such a job fails (recorded)
    # ray.init settings of the local Ray started when address is null (refused with an address: a running cluster
    # has its own), e.g. num_cpus, object_store_memory.
    local: dict[str, Any] = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/launcher", name="ray", node=RayLauncherConf, provider="ortflow")

# Ray's errors that say a job's worker process or node went away (not the job's own failure): such a job is retried.
_LOST = ("NodeDiedError", "WorkerCrashedError", "LocalRayletDiedError", "OutOfMemoryError", "ObjectLostError")


def _placed_job(
    hydra_context: HydraContext,
    task_function: TaskFunction,
    sweep_config: DictConfig,
    singleton_state: dict[Any, Any],
    placement: dict[str, Any],
) -> JobReturn:
    """In the Ray worker: the job, told where it runs (ortflow.run.placement), run as Hydra runs a sweep's job."""
    import ray

    setup_globals()
    Singleton.set_state(singleton_state)
    context = ray.get_runtime_context()
    placement = {**placement, "node_id": context.get_node_id(), "host": socket.gethostname(), "pid": os.getpid()}
    placement["node_ip"] = ray.util.get_node_ip_address()
    os.environ["ORTFLOW_PLACEMENT"] = json.dumps(placement)
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=sweep_config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


class RayLauncher(Launcher):
    def __init__(
        self,
        address: str | None,
        cpus_per_job: float,
        threads: int | None,
        resources: dict[str, float],
        max_retries: int,
        local: dict[str, Any],
    ) -> None:
        self.address, self.cpus_per_job, self.max_retries = address, cpus_per_job, max_retries
        self.threads = threads if threads is not None else max(1, -int(-cpus_per_job // 1))
        self.resources = dict(resources)
        self.local = OmegaConf.to_container(local) if isinstance(local, DictConfig) else dict(local)
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def _connect(self) -> None:
        import ray

        from ortflow.errors import OrtflowError

        if ray.is_initialized():
            return
        if self.address is not None and self.local:
            raise OrtflowError(
                f"hydra.launcher.local={self.local} sets up a local Ray, but hydra.launcher.address={self.address} "
                "connects to a running cluster, which has its own settings: leave out hydra.launcher.local, or "
                "set hydra.launcher.address=null to start a local Ray."
            )
        try:
            if self.address is None:
                ray.init(address="local", log_to_driver=True, **self.local)
            else:
                ray.init(address=self.address, log_to_driver=True)
        except ConnectionError as err:
            raise OrtflowError(
                f"cannot connect to the Ray cluster at hydra.launcher.address={self.address} ({err}): start its head "
                "with `ray start --head` and give its host:port, or set hydra.launcher.address=null for a local Ray."
            ) from None

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        import ray

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        self._connect()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        remote = ray.remote(max_calls=1, max_retries=0, num_cpus=self.cpus_per_job)(_placed_job)
        env = {"env_vars": {"OMP_NUM_THREADS": str(self.threads)}}
        log.info(
            "Ray launcher: %d jobs, %s CPUs and %d threads each, on %s",
            len(job_overrides),
            self.cpus_per_job,
            self.threads,
            self.address or "a local Ray",
        )
        jobs: dict[Any, dict[str, Any]] = {}

        def submit(job: dict[str, Any]) -> None:
            job["attempt"] += 1
            placement = {
                "launcher": "ray",
                "attempt": job["attempt"],
                "cpus": self.cpus_per_job,
                "threads": self.threads,
                "resources": job["resources"],
            }
            task = remote.options(resources=job["resources"] or None, runtime_env=env)
            ref = task.remote(self.hydra_context, self.task_function, job["config"], Singleton.get_state(), placement)
            jobs[ref] = job

        results: dict[int, JobReturn] = {}
        for n, overrides in enumerate(job_overrides):
            idx = initial_job_idx + n
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(config):
                config.hydra.job.id = f"ray_{idx}"
                config.hydra.job.num = idx
            resources = {**self.resources, **(OmegaConf.select(config, "hydra.launcher.resources") or {})}
            job = {"idx": idx, "overrides": list(overrides), "config": config, "resources": resources, "attempt": 0}
            if self._offered(resources):
                submit(job)
                continue
            results[idx] = self._failed(
                job,
                f"no live node of the cluster offers the resources it is pinned with, hydra.launcher.resources="
                f"{resources} (a node offers them with `ray start --resources`); Ray would wait for such a node for "
                "ever",
            )
        while jobs:
            (ref,), _ = ray.wait(list(jobs), num_returns=1)
            job = jobs.pop(ref)
            try:
                results[job["idx"]] = ray.get(ref)
            except ray.exceptions.RayError as err:
                lost = type(err).__name__ in _LOST
                if lost and job["attempt"] <= self.max_retries:
                    log.warning("job %d lost its Ray worker (%s); running it again", job["idx"], _first_line(err))
                    job["resources"] = self._still_offered(job["resources"], job["idx"], _lost_node(err))
                    submit(job)
                    continue
                reason = self._lost(job, err) if lost else f"Ray could not run the job: {_first_line(err)}"
                results[job["idx"]] = self._failed(job, reason)
        return [results[idx] for idx in sorted(results)]

    @staticmethod
    def _offered(resources: dict[str, float], lost: str | None = None) -> bool:
        """Whether a live node (other than `lost`) offers all of the custom `resources`. A lost node may still be
        listed alive for a while after its tasks failed (until its missed heartbeats are noticed)."""
        import ray

        if not resources:  # nothing to ask the cluster (every job of a sweep without pinned resources)
            return True
        offered = [n["Resources"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != lost]
        return any(all(r.get(k, 0) >= v for k, v in resources.items()) for r in offered)

    def _still_offered(self, resources: dict[str, float], idx: int, lost: str | None) -> dict[str, float]:
        """The job's custom resources if a live node other than the one it was lost on offers them all, else none
        (the job then runs on any live node)."""
        if self._offered(resources, lost):
            return resources
        log.warning("job %d: no live node offers %s any more; it runs again without them", idx, resources)
        return {}

    def _lost(self, job: dict[str, Any], err: Exception) -> str:
        return (
            f"lost its Ray worker or node after {job['attempt']} attempt(s) (hydra.launcher.max_retries="
            f"{self.max_retries}): {_first_line(err)}"
        )

    def _failed(self, job: dict[str, Any], reason: str) -> JobReturn:
        """A job that cannot run (again): its run.json says why, and its result is NaN (as for any failed job of an
        ortflow sweep), so that the sweep goes on and its summary lists the failure."""
        from ortflow.files import read_record, write_json_atomic
        from ortflow.run.metadata import now

        config = job["config"]
        log.error("job %d failed: %s", job["idx"], reason)
        run_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        run_dir.mkdir(parents=True, exist_ok=True)  # a job that never started has no dir yet
        record = read_record(run_dir) or {"overrides": job["overrides"]}
        record |= {"status": "failed", "error": reason, "finished": now()}
        write_json_atomic(run_dir / "run.json", record)
        with open_dict(config):
            config.hydra.runtime.output_dir = str(run_dir)  # where the sweep (and Optuna's) reads the job's record
        result = JobReturn(overrides=job["overrides"], cfg=config, hydra_cfg=config, working_dir=str(run_dir))
        result.status, result.return_value = JobStatus.COMPLETED, float("nan")
        return result


def _lost_node(err: Exception) -> str | None:
    """The node a NodeDiedError names (Ray gives it only in the message)."""
    found = re.search(r"node ID: ([0-9a-f]{56})", str(err))
    return found.group(1) if found else None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
