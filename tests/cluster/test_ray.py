"""Sweeps on a real Ray cluster the test starts (tests/helpers/clusters.py): a head and a second node on 127.0.0.1,
1 CPU each. A grid runs on both nodes, each job in a fresh worker with its CPUs and threads recorded; the second
node's raylet is killed (by pid) while a job pinned to it trains, and that job runs again on the head, continuing its
checkpoint to the same weights as an uninterrupted twin; with retries off it fails with a record while the sweep
returns the other job (and a job pinned to a resource no node offers fails at once); and an Optuna sweep runs its
trials two at a time, pruning through the study's storage."""

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.clusters import RayCluster, ray_cluster

pytestmark = pytest.mark.cluster

# Small jobs: the digits MLP, 600 steps, a checkpoint every 50 (the kill lands after the first).
JOB = [
    "+recipe=digits",
    "trainer.max_steps=600",
    "trainer.eval_every=300",
    "trainer.log_every=50",
    "trainer.checkpoint.every=50",
    "logger.progress=false",
]
# One job per file, chosen with +spot=NAME: d is a's twin, pinned to the second node by its custom resource.
SPOTS = {
    "a": "seed: 0\n",
    "b": "seed: 1\n",
    "c": "seed: 2\n",
    "d": "seed: 0\nhydra:\n  launcher:\n    resources: {second_node: 1}\n",
    "e": "seed: 1\nhydra:\n  launcher:\n    resources: {nowhere: 1}\n",  # no node offers it
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_cluster(tmp_path_factory.mktemp("ray")) as started:
        yield started


def spots(root: Path, names: str) -> list[str]:
    folder = root / "conf" / "spot"
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / f"{name}.yaml").write_text("# @package _global_\n" + SPOTS[name])
    return [f"+spot={','.join(names)}", f"hydra.searchpath=[file://{root / 'conf'}]"]


def record(job_dir: Path) -> dict:
    return json.loads((job_dir / "run.json").read_text())


def sweep(cluster: RayCluster, cwd: Path, *args: str) -> subprocess.Popen:
    """`ortflow -m ARGS` on the cluster, its driver inside the cluster's network namespace; its output in
    cwd/driver.log."""
    launcher = ["hydra/launcher=ray", f"hydra.launcher.address={cluster.address}"]
    command = cluster.command(sys.executable, "-m", "ortflow", "-m", *args, *launcher)
    with (cwd / "driver.log").open("w") as output:
        driver = subprocess.Popen(command, cwd=cwd, env=cluster.env, stdout=output, stderr=subprocess.STDOUT)
    driver.log = cwd / "driver.log"  # type: ignore[attr-defined]
    return driver


def kill_when_training(cluster: RayCluster, job_dir: Path, node_id: str, killed: list[int]) -> threading.Thread:
    """Kill node `node_id` once the job in `job_dir` runs there and has written a checkpoint, as a machine dies: the
    job's worker is frozen at once (a small job would otherwise finish its last steps, and hand its result to the
    driver, while the dead raylet's worker is still winding down), then the raylet and the worker are killed."""

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                placement = record(job_dir).get("placement", {})
            except (OSError, ValueError):
                placement = {}
            if placement.get("node_id") == node_id and any((job_dir / "checkpoints").glob("step-*.pt")):
                worker = placement["pid"]
                os.kill(worker, signal.SIGSTOP)
                raylet = cluster.raylet_pid(node_id)
                killed.append(raylet)
                os.kill(raylet, signal.SIGKILL)
                os.kill(worker, signal.SIGKILL)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def finish(driver: subprocess.Popen, timeout: int = 300) -> str:
    try:
        driver.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=60)
        pytest.fail(f"the sweep did not end in {timeout} s:\n{driver.log.read_text()[-5000:]}")
    return driver.log.read_text()


def test_optuna_runs_trials_two_at_a_time_on_the_cluster_and_prunes_through_the_storage(cluster, tmp_path):
    import optuna

    sweep_dir = tmp_path / "optuna"
    args = [
        "+recipe=digits",
        "+hparams_search=optuna",
        "trainer.max_steps=60",
        "trainer.eval_every=10",
        "logger.progress=false",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.params={optim.lr: {type: float, low: 1e-5, high: 1e-1, log: true}}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    out = finish(sweep(cluster, tmp_path, *args))
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    statuses = [r["status"] for r in rows]
    assert len(rows) == 4 and statuses.count("pruned") >= 1 and set(statuses) <= {"completed", "pruned"}, out[-5000:]
    records = [record(sweep_dir / r["job"]) for r in rows]
    # Pruned in the job's own process on a Ray node: it reported to its trial through the SQLite storage.
    assert all(r["placement"]["launcher"] == "ray" for r in records)
    assert all(r["ended_by"] == "pruned" and r["metrics"]["steps"] < 60 for r in records if r["status"] == "pruned")
    study = optuna.load_study(study_name="ortflow", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    states = [t.state.name for t in sorted(study.trials, key=lambda t: t.number)]
    assert states == ["COMPLETE" if s == "completed" else "PRUNED" for s in statuses]
    for trial in study.trials:  # every evaluation before the last step reached the study from the job
        steps = records[trial.number]["metrics"]["steps"]
        assert sorted(trial.intermediate_values) == list(range(10, min(steps, 59) + 1, 10))
    # Two at a time: each batch's trials ran side by side, one on each node.
    for first, second in zip(records[::2], records[1::2], strict=True):
        assert first["placement"]["node_id"] != second["placement"]["node_id"]
        assert first["started"] <= second["finished"] and second["started"] <= first["finished"]


def test_a_grid_on_two_nodes_survives_a_killed_node_and_its_job_resumes_elsewhere(cluster, tmp_path):
    sweep_dir = tmp_path / "grid"
    second = cluster.second_node()
    killed: list[int] = []
    driver = sweep(cluster, tmp_path, *JOB, *spots(tmp_path, "abcd"), f"hydra.sweep.dir={sweep_dir}")
    watcher = kill_when_training(cluster, sweep_dir / "3", second, killed)
    out = finish(driver)
    watcher.join(timeout=1)
    assert killed, f"the pinned job never trained on the second node:\n{out[-5000:]}"
    assert driver.returncode == 0, out[-5000:]
    records = {n: record(sweep_dir / str(n)) for n in range(4)}
    assert all(r["status"] == "completed" for r in records.values()), out[-5000:]
    for r in records.values():  # each job in a fresh worker, with the CPUs and threads it was given
        placement = r["placement"]
        assert placement["cpus"] == 1 and placement["threads"] == 1 and r["host"]["torch_threads"] == 1
        assert placement["host"] and len(placement["node_id"]) == 56
    pinned = records[3]
    lost = pinned["attempts"][-1]
    assert lost["placement"]["node_id"] == second and lost["status"] == "running"  # its node died under it
    assert pinned["placement"]["attempt"] == 2 and pinned["placement"]["node_id"] != second
    assert pinned["placement"]["resources"] == {}  # no live node offered second_node any more
    assert pinned["resumed_from"]["step"] >= 50  # continued its checkpoint
    nodes = {r["placement"]["node_id"] for r in records.values()} | {lost["placement"]["node_id"]}
    assert len(nodes) >= 2
    pids = [r["placement"]["pid"] for r in records.values()] + [lost["placement"]["pid"]]
    assert len(set(pids)) == 5  # max_calls=1: no worker process ran two jobs
    # Resumed exactly: the same weights as its twin (job 0, seed 0) that was never interrupted.
    twin = torch.load(sweep_dir / "0" / "checkpoints" / "final.pt", weights_only=True)
    resumed = torch.load(sweep_dir / "3" / "checkpoints" / "final.pt", weights_only=True)
    assert twin.keys() == resumed.keys() and all(torch.equal(twin[k], resumed[k]) for k in twin)
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["completed"] * 4
    assert rows[3]["placement"] == f"{pinned['placement']['host']} node {pinned['placement']['node_id'][:8]}"


def test_with_retries_off_a_lost_job_fails_with_a_record_and_the_sweep_returns_the_others(cluster, tmp_path):
    sweep_dir = tmp_path / "noretry"
    second = cluster.second_node()
    killed: list[int] = []
    args = [*JOB, *spots(tmp_path, "ade"), "hydra.launcher.max_retries=0", f"hydra.sweep.dir={sweep_dir}"]
    driver = sweep(cluster, tmp_path, *args)
    watcher = kill_when_training(cluster, sweep_dir / "1", second, killed)
    out = finish(driver)
    watcher.join(timeout=1)
    assert killed, out[-5000:]
    assert driver.returncode == 1, out[-5000:]  # a failed job makes the sweep exit non-zero, after its summary
    assert record(sweep_dir / "0")["status"] == "completed"
    failed = record(sweep_dir / "1")
    assert failed["status"] == "failed" and "lost its Ray worker or node" in failed["error"]
    assert "max_retries=0" in failed["error"]
    # Pinned to a resource no node offers: refused at once with a record, not left waiting for such a node.
    unplaced = record(sweep_dir / "2")
    assert unplaced["status"] == "failed" and "no live node of the cluster offers" in unplaced["error"]
    assert "'nowhere': 1" in unplaced["error"]
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["completed", "failed", "failed"]
