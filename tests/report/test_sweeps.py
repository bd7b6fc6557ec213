"""Run metadata, determinism, multirun summaries, sweep resume, Optuna and ortflow-compare."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ortflow.cli.compare import main as compare
from tests.conftest import TINY, run_cli, run_dirs
from tests.report.test_terminal import curve_colours

# Bitwise: the same seed, data order, thread count and kernels give the same floats in eager PyTorch.
# ORTModule: ORT's kernels are deterministic on CPU too, but we do not promise bits across its graph rebuilds;
# this bound is 1000x below the step-to-step change of the loss.
RTOL_ORT_REPEAT = 1e-6


def losses(run_dir: Path) -> list[float]:
    points = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [p["train/loss"] for p in points if "train/loss" in p]


def sweep(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`ortflow -m ARGS` on the tiny config, into a fixed sweep dir."""
    sweep_dir = tmp_path / "sweep"
    return run_cli("-m", *args, *TINY, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path), sweep_dir


def summary(sweep_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((sweep_dir / "summary.csv").open()))


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.slow
def test_run_json_records_command_code_versions_host_seed_and_engine(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "notes.txt").write_text("x")
    git(tmp_path, "add", "notes.txt")
    git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "init")
    (tmp_path / "notes.txt").write_text("changed")  # a dirty tree
    result = run_cli("accel=ortmodule", "seed=7", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((run_dirs(tmp_path)[0] / "run.json").read_text())
    assert record["status"] == "completed"
    assert record["overrides"][:2] == ["accel=ortmodule", "seed=7"] and "ortflow" in " ".join(record["command"])
    assert len(record["git"]["commit"]) == 40 and record["git"]["dirty"] is True
    assert set(record["versions"]) == {"python", "torch", "onnxruntime-training", "onnx", "hydra"}
    assert record["host"]["cpu_count"] >= 1 and "gpus" in record["host"]
    assert record["host"]["malloc"]["allocator"] in ("steady", "not glibc malloc: left as it is")
    assert record["seed"] == 7 and record["config"]["seed"] == 7 and record["config"]["data"]["seed"] == 7
    assert record["engine"]["executed_by"] == "onnxruntime"


def test_a_failed_run_is_recorded_with_its_error(tmp_path, ortflow_cli):
    status, _ = ortflow_cli("data.source=/no/such/file.txt", *TINY, cwd=tmp_path)
    assert status == 2
    record = json.loads((run_dirs(tmp_path)[0] / "run.json").read_text())
    assert record["status"] == "failed" and "/no/such/file.txt" in record["error"]


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["none", "ortmodule", "artifacts"])
def test_same_config_twice_gives_the_same_loss_curve(accel, tmp_path):
    for _ in range(2):
        assert run_cli(f"accel={accel}", "seed=3", *TINY, cwd=tmp_path).returncode == 0
    assert run_cli(f"accel={accel}", "seed=4", *TINY, cwd=tmp_path).returncode == 0
    first, second, other_seed = (losses(d) for d in run_dirs(tmp_path))
    if accel == "none":
        assert first == second  # bit for bit
    else:
        assert first == pytest.approx(second, rel=RTOL_ORT_REPEAT)
    assert first != other_seed


@pytest.mark.slow
def test_multirun_runs_every_combination_and_summarises_at_the_sweep_root(tmp_path):
    result, sweep_dir = sweep(tmp_path, "optim.lr=1e-3,3e-3", "accel=none,ortmodule")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = summary(sweep_dir)
    assert len(rows) == 4 and {r["status"] for r in rows} == {"completed"}
    assert {r["executed_by"] for r in rows} == {"pytorch", "onnxruntime"}
    assert {r["overrides"].split()[0] for r in rows} == {"optim.lr=0.001", "optim.lr=0.003"}  # as Hydra writes them
    # TensorBoard hparams for the HPARAMS tab, one per job
    assert len(list(sweep_dir.glob("*/tensorboard/hparams/events.out.tfevents.*"))) == 4
    assert (sweep_dir / "summary.md").read_text().count("| completed |") == 4
    assert curve_colours(sweep_dir / "summary.png") == 4  # one curve per job


@pytest.mark.slow
def test_a_failing_job_is_reported_and_the_others_still_run(tmp_path):
    result, sweep_dir = sweep(tmp_path, "data.source=python_docs,/no/such/corpus.txt")
    assert result.returncode != 0  # the sweep as a whole reports the failure
    rows = {r["job"]: r for r in summary(sweep_dir)}
    assert rows["0"]["status"] == "completed"
    assert rows["1"]["status"] == "failed" and "/no/such/corpus.txt" in rows["1"]["error"]


@pytest.mark.slow
def test_rerunning_an_interrupted_sweep_runs_only_the_unfinished_jobs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "seed=1,2,3", *TINY, "trainer.max_steps=30", f"hydra.sweep.dir={sweep_dir}"]
    cmd = [sys.executable, "-m", "ortflow", *args]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    first = sweep_dir / "0" / "run.json"
    while time.monotonic() < deadline:
        if first.exists() and json.loads(first.read_text())["status"] == "completed":
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep dies in job 1
    proc.wait()
    done_before = json.loads(first.read_text())
    assert done_before["status"] == "completed"

    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(first.read_text()) == done_before  # job 0 was not run again
    assert [r["status"] for r in summary(sweep_dir)] == ["completed"] * 3
    if (sweep_dir / "1" / "previous-attempt-1").exists():  # job 1 had started: its partial outputs are kept
        assert json.loads((sweep_dir / "1" / "previous-attempt-1" / "run.json").read_text())["status"] == "running"


@pytest.mark.slow
def test_optuna_search_returns_the_objective_and_records_the_best_trial(tmp_path):
    result, sweep_dir = sweep(tmp_path, "+hparams_search=optuna", "hydra.sweeper.n_trials=3")
    assert result.returncode == 0, result.stderr[-3000:]
    best = (sweep_dir / "optimization_results.yaml").read_text()
    assert "best_params" in best and "optim.lr" in best
    best_value = float(best.split("best_value:")[1].split()[0])
    assert best_value == pytest.approx(min(float(r["eval/loss"]) for r in summary(sweep_dir)))


def test_a_wrong_objective_name_is_an_error_not_a_silent_none(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli("objective=eval/los", *TINY, cwd=tmp_path)
    assert status == 2 and "objective='eval/los'" in stderr


def test_compare_prints_the_differing_keys_and_the_metrics(tmp_path, capsys):
    for lr, loss in (("0.001", 2.5), ("0.003", 2.1)):
        run = tmp_path / lr
        run.mkdir()
        config = {"optim": {"lr": float(lr), "name": "adamw"}, "seed": 0}
        record = {"status": "completed", "config": config, "metrics": {"eval/loss": loss}, "engine": {}}
        (run / "run.json").write_text(json.dumps(record))
    compare([str(tmp_path / "0.001"), str(tmp_path / "0.003")])
    out = capsys.readouterr().out
    assert "optim.lr" in out and "0.001" in out and "0.003" in out
    assert "optim.name" not in out  # equal keys are not listed
    assert "2.5" in out and "2.1" in out


def test_compare_names_a_directory_without_a_run_record(tmp_path):
    with pytest.raises(SystemExit, match=r"run\.json does not exist"):
        compare([str(tmp_path), str(tmp_path)])


OPTUNA = [
    "+recipe=digits",
    "+hparams_search=optuna",
    "trainer.max_steps=60",
    "trainer.eval_every=10",
    "hydra.sweeper.params={optim.lr: {type: float, low: 1e-5, high: 1e-1, log: true}}",
]


@pytest.mark.slow
def test_an_optuna_sweep_prunes_unpromising_trials_and_resumes(tmp_path):
    import optuna

    sweep_dir = tmp_path / "optuna"
    result = run_cli("-m", *OPTUNA, "hydra.sweeper.n_trials=6", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = summary(sweep_dir)
    statuses = [r["status"] for r in rows]
    assert len(rows) == 6 and statuses.count("pruned") >= 1 and set(statuses) <= {"completed", "pruned"}, statuses
    # A pruned trial stopped at an evaluation before the end; the study agrees with the run records.
    pruned = [json.loads((sweep_dir / r["job"] / "run.json").read_text()) for r in rows if r["status"] == "pruned"]
    assert all(p["ended_by"] == "pruned" and p["metrics"]["steps"] < 60 for p in pruned)
    storage = f"sqlite:///{sweep_dir / 'optuna.db'}"
    study = optuna.load_study(study_name="ortflow", storage=storage)
    states = [t.state.name for t in sorted(study.trials, key=lambda t: t.number)]
    assert states == ["COMPLETE" if s == "completed" else "PRUNED" for s in statuses]
    best = min(float(r["eval/loss"]) for r in rows if r["status"] == "completed")
    assert study.best_value == pytest.approx(best)
    assert f"eval/loss = {best:.6g}" in (sweep_dir / "summary.md").read_text()
    # An interrupted run of the sweep leaves a trial running; the same command again (here with more trials) marks
    # it failed and continues the study in the same sweep dir until 8 trials have finished.
    study.ask()
    again = run_cli("-m", *OPTUNA, "hydra.sweeper.n_trials=8", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = sorted(optuna.load_study(study_name="ortflow", storage=storage).trials, key=lambda t: t.number)
    assert [t.state.name for t in trials][6] == "FAIL" and len(trials) == 9
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in trials) == 8
    assert [r["job"] for r in summary(sweep_dir)] == ["0", "1", "2", "3", "4", "5", "7", "8"]


def test_the_summary_names_where_a_launcher_ran_each_job(tmp_path):
    from ortflow.report.sweep import write_summary

    placements = [
        {"launcher": "ray", "node_id": "5c8790c1" + "0" * 48, "host": "n1"},
        {"launcher": "slurm", "job_id": "12", "host": "n2"},
    ]
    for job, where in enumerate(placements):
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        record = {"status": "completed", "overrides": [f"seed={job}"], "metrics": {}, "placement": where}
        (tmp_path / str(job) / "run.json").write_text(json.dumps(record))
    rows = write_summary(tmp_path)
    assert [r["placement"] for r in rows] == ["n1 node 5c8790c1", "n2 job 12"]
    assert [r["placement"] for r in summary(tmp_path)] == ["n1 node 5c8790c1", "n2 job 12"]
