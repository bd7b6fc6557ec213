"""The SLURM preset for real: a sweep through `hydra/launcher=slurm` (Hydra's submitit launcher) on a one-node SLURM
the test starts (tests/helpers/clusters.py), one job preempted as submitit delivers it (`job._interrupt()`: SIGTERM,
then SIGUSR2) and requeued by submitit, continuing its checkpoint to the weights of an uninterrupted twin; and the
preset's rendezvous wiring: two ortflow processes given a 2-node SLURM job's variables make one DDP run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.clusters import free_port, slurm_cluster

pytestmark = pytest.mark.cluster

JOB = [
    "+recipe=digits",
    "trainer.max_steps=600",
    "trainer.eval_every=300",
    "trainer.checkpoint.every=50",
    "logger.progress=false",
]


def record(job_dir: Path) -> dict:
    return json.loads((job_dir / "run.json").read_text())


def wait_for(ready, what: str, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-5000:]}")
        time.sleep(0.2)


def test_a_sweep_on_slurm_is_preempted_requeued_by_submitit_and_resumes_exactly(tmp_path, monkeypatch):
    import submitit

    with slurm_cluster(tmp_path / "slurm") as cluster:
        monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])  # scancel, called by submitit here
        sweep_dir = tmp_path / "sweep"
        # Two jobs that train the same model: the logging cadence changes no weight. Job 1 is preempted.
        args = ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=test", *JOB, "trainer.log_every=50,25"]
        log = tmp_path / "driver.log"
        with log.open("w") as output:
            command = [sys.executable, "-m", "ortflow", *args, f"hydra.sweep.dir={sweep_dir}"]
            driver = subprocess.Popen(command, cwd=tmp_path, env=cluster.env, stdout=output, stderr=subprocess.STDOUT)
        job_dir = sweep_dir / "1"

        def training() -> bool:
            try:
                placed = record(job_dir).get("placement", {})
            except (OSError, ValueError):
                return False
            return placed.get("launcher") == "slurm" and any((job_dir / "checkpoints").glob("step-*.pt"))

        wait_for(training, "job 1 to train on SLURM", log)
        placed = record(job_dir)["placement"]
        job_id = f"{placed['array_job_id']}_{placed['array_task_id']}"  # this array task (the bare id names them all)
        job = submitit.SlurmJob(folder=sweep_dir / ".submitit" / "%j", job_id=job_id)
        job._interrupt()  # preemption: SIGTERM, then submitit's SIGUSR2
        cluster.start_requeued_now(job_id)
        try:
            driver.wait(timeout=300)  # about 20 s on a quiet 2-core machine
        except subprocess.TimeoutExpired:
            logs = "".join(f"{p}:\n{p.read_text()[-3000:]}\n" for p in (sweep_dir / ".submitit").rglob("*_log.*"))
            # The jobs' own logs last, where a shortened report keeps them
            pytest.fail(f"the sweep did not end:\n{cluster.diagnosis(job_id)}\n{log.read_text()[-3000:]}\n{logs}")
        finally:
            if driver.poll() is None:
                driver.kill()
        output = log.read_text()
        assert driver.returncode == 0, output[-5000:]
        preempted = record(job_dir)
        assert preempted["status"] == "completed", output[-5000:]
        assert preempted["placement"]["restart_count"] == "1"  # requeued once, by submitit
        assert preempted["attempts"][-1]["status"] == "preempted"  # stopped with its checkpoint written
        assert preempted["resumed_from"]["step"] >= 50  # and continued it (trainer.resume=auto implied)
        assert record(sweep_dir / "0")["status"] == "completed"
        twin = torch.load(sweep_dir / "0" / "checkpoints" / "final.pt", weights_only=True)
        resumed = torch.load(job_dir / "checkpoints" / "final.pt", weights_only=True)
        assert twin.keys() == resumed.keys() and all(torch.equal(twin[k], resumed[k]) for k in twin)
        assert "requeue" in "".join(p.read_text() for p in (sweep_dir / ".submitit").rglob("*_log.err")).lower()


def test_the_presets_rendezvous_wiring_makes_one_ddp_run_of_two_slurm_nodes(tmp_path):
    """conf/distributed/ddp.yaml takes the node rank from SLURM_NODEID and node 0's address from
    SLURM_LAUNCH_NODE_IPADDR (the port from MASTER_PORT): two ortflow processes given a 2-node job's variables."""
    common = [
        "+recipe=digits",
        "trainer.max_steps=20",
        "trainer.eval_every=10",
        "accel=ortmodule",
        "distributed=ddp",
        "distributed.nnodes=2",
        "distributed.nproc_per_node=1",
        "logger.progress=false",
    ]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "MASTER_PORT": str(free_port())}
    slurm["SLURM_LAUNCH_NODE_IPADDR"] = "127.0.0.1"
    nodes = []
    for n in (0, 1):
        env = {**os.environ, **slurm, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)}
        command = [sys.executable, "-m", "ortflow", *common, f"hydra.run.dir=node{n}"]
        nodes.append(subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True))
    errors = [node.communicate(timeout=300)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    run = record(tmp_path / "node0")
    assert run["config"]["distributed"]["node_rank"] == 0
    assert run["config"]["distributed"]["rdzv_endpoint"] == f"127.0.0.1:{slurm['MASTER_PORT']}"
    engine = run["engine"]
    assert engine["world_size"] == 2 and engine["replicas_identical"]
    assert engine["ranks_executed_by"] == ["onnxruntime"] * 2
    assert run["placement"]["launcher"] == "slurm" and run["placement"]["job_id"] == "4242"
    assert not (tmp_path / "node1" / "run.json").exists()  # node 1's rank writes nothing
