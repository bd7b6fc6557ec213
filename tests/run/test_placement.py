"""Where a launcher placed a sweep job (run.json's `placement`), whether its scheduler ran it again, the Ray
launcher's record of a job it cannot run again, and a pruning job's reach to the study's storage."""

import json
import socket

import pytest
from omegaconf import OmegaConf

from ortflow.errors import OrtflowError
from ortflow.report.sweep import job_rows
from ortflow.run import placement, pruning


def test_placement_comes_from_the_ray_launcher_or_slurms_variables(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", placement.PLACEMENT):
        monkeypatch.delenv(name, raising=False)
    assert placement.placement() is None and placement.rerun() is None
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert placement.placement() == {"launcher": "slurm", "job_id": "7", "node_id": "0"}
    assert placement.rerun() is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert "SLURM requeued job 7" in placement.rerun()
    ray = {"launcher": "ray", "node_id": "ab" * 28, "host": "h", "attempt": 1}
    monkeypatch.setenv(placement.PLACEMENT, json.dumps(ray))  # the launcher's word comes first
    assert placement.placement() == ray and placement.rerun() is None
    monkeypatch.setenv(placement.PLACEMENT, json.dumps(ray | {"attempt": 2}))
    assert "ray launcher ran this job again (attempt 2)" in placement.rerun()


def test_a_job_the_ray_launcher_cannot_run_again_is_recorded_failed(tmp_path):
    pytest.importorskip("ray")
    from hydra_plugins.ortflow_ray.launcher import RayLauncher, _lost_node

    job_dir = tmp_path / "3"
    job_dir.mkdir()
    (job_dir / "run.json").write_text(json.dumps({"status": "running", "overrides": ["seed=3"]}))
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path), "subdir": "3"}, "runtime": {}}})
    launcher = RayLauncher(None, 1, None, {}, 0, {})
    message = "Task failed because the node it was running on is dead. Node IP: 127.0.0.1, node ID: " + "c0" * 28
    job = {"idx": 3, "overrides": ["seed=3"], "config": config, "attempt": 1}
    result = launcher._failed(job, launcher._lost(job, OSError(message)))
    saved = json.loads((job_dir / "run.json").read_text())
    assert saved["status"] == "failed" and "max_retries=0" in saved["error"] and saved["overrides"] == ["seed=3"]
    assert result.return_value != result.return_value  # NaN, as every failed job of a sweep returns
    assert result.hydra_cfg.hydra.runtime.output_dir == str(job_dir)
    assert _lost_node(OSError(message)) == "c0" * 28 and _lost_node(OSError("gone")) is None
    # A job that never started (pinned to resources no node offers) gets its dir and record, listed by the summary.
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path), "subdir": "4"}, "runtime": {}}})
    launcher._failed({"idx": 4, "overrides": ["seed=4"], "config": config, "attempt": 0}, "no live node offers it")
    assert json.loads((tmp_path / "4" / "run.json").read_text())["error"] == "no live node offers it"
    assert [r["job"] for r in job_rows(tmp_path)] == ["3", "4"]


def test_the_ray_launchers_local_settings_are_refused_with_an_address():
    pytest.importorskip("ray")
    from hydra_plugins.ortflow_ray.launcher import RayLauncher

    launcher = RayLauncher("10.0.0.1:6379", 1, None, {}, 2, {"object_store_memory": 10**8})
    with pytest.raises(OrtflowError, match=r"hydra\.launcher\.local=.*hydra\.launcher\.address=10\.0\.0\.1:6379"):
        launcher._connect()
    assert launcher.threads == 1 and RayLauncher(None, 2.5, None, {}, 2, {}).threads == 3


def test_a_pruning_job_reports_to_its_trial_through_the_storage_with_the_sweeps_pruner(tmp_path, monkeypatch):
    import optuna

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    pruner = {"_target_": "optuna.pruners.ThresholdPruner", "upper": 1.0}
    monkeypatch.setenv(pruning.TRIAL, pruning.trial_env(storage, "s", trial._trial_id, trial.number, pruner))
    report = pruning.reporter("eval/loss")
    assert report(10, {"eval/loss": 0.5}) is False and report(20, {"eval/accuracy": 0.9}) is False
    assert (
        report(30, {"eval/loss": 2.0}) is True
    )  # above the sweep's threshold: the sweep's pruner, not Optuna's default
    frozen = optuna.load_study(study_name="s", storage=storage).trials[0]
    assert frozen.intermediate_values == {10: 0.5, 30: 2.0}
    assert pruning.reporter("train/loss") is None  # measured only at the end: nothing to report
    monkeypatch.delenv(pruning.TRIAL)
    assert pruning.reporter("eval/loss") is None  # not a job of a pruning sweep


def test_an_sqlite_study_is_refused_on_another_host_or_where_its_file_is_missing(tmp_path):
    spec = {"storage": f"sqlite:///{tmp_path / 'optuna.db'}", "host": "elsewhere"}
    with pytest.raises(OrtflowError, match=r"SQLite file on the sweep's host elsewhere.*postgresql://"):
        pruning.check_reachable(spec)
    with pytest.raises(OrtflowError, match=r"optuna\.db \(hydra\.sweeper\.storage\) does not exist"):
        pruning.check_reachable(spec | {"host": socket.gethostname()})
    pruning.check_reachable({"storage": "postgresql://u:p@db/optuna", "host": "elsewhere"})  # a server: any host


def test_the_ray_launcher_composes_with_its_defaults_and_per_job_resources():
    from hydra import compose, initialize_config_dir

    from ortflow.paths import config_dir

    overrides = ["hydra/launcher=ray", "hydra.launcher.cpus_per_job=2", "+hydra.launcher.resources.gpu_node=1"]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides, return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.ortflow_ray.launcher.RayLauncher"
    assert launcher.address is None and launcher.cpus_per_job == 2 and launcher.threads is None
    assert launcher.max_retries == 2 and dict(launcher.resources) == {"gpu_node": 1}
