"""Ordinary mistakes and shortcuts a new user makes: a quick run of a long recipe, a smoke run, a corrected command
in the same run dir, out of memory, a diverging lr. Each either works or is one paragraph naming the keys."""

import json

import pytest

from ortflow.run import checkpoint
from tests.conftest import TINY, USER_ENV, custom_model


def record(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def test_a_recipe_shortened_to_a_few_steps_runs_with_its_warmup_cut(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(
        "+recipe=transformer", *TINY[:6], "trainer.max_steps=3", "hydra.run.dir=r", cwd=tmp_path
    )
    assert status == 0, stderr[-2000:]
    assert (
        "scheduler.warmup_steps=20 is longer than trainer.max_steps=3" in (tmp_path / "r" / "ortflow.log").read_text()
    )
    assert record(tmp_path / "r")["metrics"]["steps"] == 3


def test_fast_dev_run_trains_a_few_steps_with_one_eval_batch_and_no_checkpoints(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli("+recipe=digits", "trainer.fast_dev_run=2", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 0, stderr[-2000:]
    run = record(tmp_path / "r")
    assert run["metrics"]["steps"] == 2 and run["config"]["trainer"]["eval_batches"] == 1
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_a_failed_start_leaves_the_run_dir_to_the_corrected_command(tmp_path, ortflow_cli):
    status, _ = ortflow_cli(*TINY, "optim.lr=-1", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and record(tmp_path / "r")["stage"] == "starting"
    status, stderr = ortflow_cli(*TINY, "hydra.run.dir=r", cwd=tmp_path)
    assert status == 0, stderr[-2000:]
    run = record(tmp_path / "r")
    assert run["status"] == "completed" and run["attempts"][0]["status"] == "failed"
    assert "optim.lr" in run["attempts"][0]["error"]
    # A run that trained is still never written over.
    status, stderr = ortflow_cli(*TINY, "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and "already holds a run" in stderr


def test_out_of_memory_names_the_keys_that_size_a_step(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(USER_ENV["PYTHONPATH"].split(":")[0])
    args = [*custom_model("build_out_of_memory"), *TINY[4:], "trainer.checkpoint.every=1", "hydra.run.dir=r"]
    status, stderr = ortflow_cli(*args, cwd=tmp_path)
    assert status == 2 and "ran out of memory" in stderr and "data.batch_size=8" in stderr
    assert "Traceback" not in stderr and record(tmp_path / "r")["status"] == "failed"
    assert checkpoint.step_checkpoints(tmp_path / "r" / "checkpoints") == []


def test_a_diverging_run_names_lr_and_eps(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(USER_ENV["PYTHONPATH"].split(":")[0])
    args = [*custom_model("build_nan_at_step", nan_steps=[2]), *TINY[4:], "hydra.run.dir=r"]
    status, stderr = ortflow_cli(*args, cwd=tmp_path)
    assert status == 2 and "at step 2" in stderr and "optim.lr=0.001" in stderr and "optim.eps=1e-08" in stderr


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("accel", ["none", "ortmodule", "artifacts"])
def test_runs_of_one_and_two_steps_finish_with_a_summary(tmp_path, ortflow_cli, accel, steps):
    status, stderr = ortflow_cli(
        "+recipe=digits", f"accel={accel}", f"trainer.max_steps={steps}", "hydra.run.dir=r", cwd=tmp_path
    )
    assert status == 0, stderr[-2000:]
    run = record(tmp_path / "r")
    assert run["status"] == "completed" and run["metrics"]["steps"] == steps
    assert checkpoint.step_checkpoints(tmp_path / "r" / "checkpoints")
    if accel != "none":
        assert run["engine"]["ort_train_steps"] == steps
    rate = run["metrics"]["perf/samples_per_sec"]
    assert (rate is None) == (steps == 1)  # the first step pays for start-up and is never timed
    assert list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))
