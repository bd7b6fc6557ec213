"""logger=[tensorboard,mlflow] (and csv) against a real MLflow tracking server the tests start on loopback: what a run
sends (params, metrics at TensorBoard's steps, tags, artifacts) read back through MLflow's client; the server killed
mid-run; kill -9 and trainer.resume=auto continuing the same MLflow run; the errors at start."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ortflow.run import checkpoint
from tests.conftest import REPO
from tests.helpers.mlflow_server import MLflowServer, optuna_sweep

DIGITS = [
    "+recipe=digits",
    "trainer.log_every=5",
    "trainer.eval_every=10",
    "logger.progress=false",
]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = MLflowServer(tmp_path_factory.mktemp("mlflow"))
    yield started
    started.stop()


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ortflow", *args],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ortflow", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )


def points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's points (what TensorBoard got) by tag, the points superseded by a resume left out."""
    by_step: dict[tuple[str, int], float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        point = json.loads(line)
        if "resumed_from_step" in point:
            by_step = {k: v for k, v in by_step.items() if k[1] <= point["resumed_from_step"]}
            continue
        step = point.pop("step")
        by_step |= {(tag, step): value for tag, value in point.items()}
    out: dict[str, list[tuple[int, float]]] = {}
    for (tag, step), value in sorted(by_step.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(tag, []).append((step, value))
    return out


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line).get("step", 0) for line in lines if line.endswith("}")), default=0)


def wait_for(condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "mlflow.json").read_text())["run_id"]


@pytest.mark.slow
def test_a_run_sends_params_metrics_tags_and_artifacts(server, tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
        cwd=tmp_path,
        check=True,
    )
    args = [
        *DIGITS,
        "logger=[tensorboard,mlflow,csv]",
        f"logger.mlflow.tracking_uri={server.uri}",
        "logger.mlflow.log_model=true",
        "trainer.max_steps=20",
        "hydra.run.dir=run",
    ]
    result = run(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, client = tmp_path / "run", server.client()
    done = record(run_dir)
    got = client.get_run(run_id(run_dir))
    assert got.info.status == "FINISHED"
    assert client.get_experiment(got.info.experiment_id).name == "digits"  # the recipe's name
    assert done["mlflow"]["run_id"] == got.info.run_id and "error" not in done["mlflow"]
    # The resolved config, flattened.
    assert got.data.params["trainer.max_steps"] == "20"
    assert got.data.params["optim.lr"] == str(done["config"]["optim"]["lr"])
    assert got.data.params["model.hidden"] == json.dumps(done["config"]["model"]["hidden"])
    # The same tags at the same steps as TensorBoard (metrics.jsonl), with the same values.
    expected = points(run_dir)
    assert {"train/loss", "eval/loss", "eval/accuracy", "engine/ort_executed"} <= set(expected)
    # ... and the final metrics TensorBoard's HPARAMS tab gets, as final/<name> at the last step.
    final = {f"final/{k}": v for k, v in done["metrics"].items() if isinstance(v, float)}
    assert "final/eval/accuracy" in final and set(got.data.metrics) == set(expected) | set(final)
    for tag, value in final.items():
        assert history(client, got.info.run_id, tag) == [(20, pytest.approx(value))], tag
    for tag, series in expected.items():
        sent = history(client, got.info.run_id, tag)
        assert [step for step, _ in sent] == [step for step, _ in series], tag
        assert [value for _, value in sent] == pytest.approx([value for _, value in series], rel=1e-6), tag
    # What executed it.
    tags = got.data.tags
    assert tags["executed_by"] == done["engine"]["executed_by"] == "pytorch"
    assert tags["precision"] == done["precision"]
    assert tags["engine"] == "none"
    assert tags["torch_version"] == torch.__version__
    assert tags["git_commit"] == done["git"]["commit"]
    assert tags["host"] == done["host"]["hostname"]
    assert tags["ortflow_version"]
    # run.json (as it ended) and the config as artifacts.
    from mlflow.artifacts import download_artifacts

    names = {a.path for a in client.list_artifacts(got.info.run_id)}
    assert {"run.json", "config.yaml"} <= names
    # logger.mlflow.log_model: the final weights, loadable as they are.
    assert [a.path for a in client.list_artifacts(got.info.run_id, "model")] == ["model/final.pt"]
    weights = download_artifacts(
        run_id=got.info.run_id, artifact_path="model/final.pt", dst_path=str(tmp_path / "dl"), tracking_uri=server.uri
    )
    sent_weights, kept = torch.load(weights, weights_only=True), torch.load(run_dir / "checkpoints" / "final.pt")
    assert sent_weights.keys() == kept.keys() and all(torch.equal(sent_weights[k], kept[k]) for k in kept)
    uploaded = json.loads(
        Path(
            download_artifacts(
                run_id=got.info.run_id, artifact_path="run.json", dst_path=str(tmp_path / "dl"), tracking_uri=server.uri
            )
        ).read_text()
    )
    assert uploaded["status"] == "completed" and uploaded["metrics"] == done["metrics"]
    # logger.csv: the same points, one row each.
    with (run_dir / "metrics.csv").open(newline="") as file:
        rows = sorted((r["name"], int(r["step"]), float(r["value"])) for r in csv.DictReader(file))
    assert rows == sorted((tag, step, value) for tag, series in expected.items() for step, value in series)


@pytest.mark.slow
def test_the_server_killed_mid_run_costs_one_warning_and_the_run_completes(tmp_path):
    server = MLflowServer(tmp_path / "mlflow")
    try:
        args = [
            *DIGITS,
            "logger=[tensorboard,mlflow]",
            f"logger.mlflow.tracking_uri={server.uri}",
            "trainer.max_steps=60",
            "+callbacks.paced._target_=tests.helpers.callbacks.Paced",
            "+callbacks.paced.seconds=0.1",
            "hydra.run.dir=run",
        ]
        proc = start(args, tmp_path)
        run_dir = tmp_path / "run"
        wait_for(lambda: last_step(run_dir) >= 10)
        client = server.client()
        sent = history(client, run_id(run_dir), "train/loss")
        assert sent, "the server received nothing before it was killed"
        server.stop(signal.SIGKILL)
        assert record(run_dir)["status"] == "running", "the run ended before the server was killed"
        out, err = proc.communicate(timeout=600)
    finally:
        server.stop()
    assert proc.returncode == 0, err[-3000:]
    # One warning on the terminal, naming the URI (the summary's mlflow row says what was missed), and no other of
    # ortflow's about the server in the log (which also keeps urllib3's line about its one retry).
    terminal = " ".join((out + err).split())
    assert terminal.count(f"MLflow tracking at {server.uri} failed") == 1, terminal[-3000:]
    log = (tmp_path / "run" / "ortflow.log").read_text().splitlines()
    about_server = [line for line in log if "][ortflow." in line and "WARNING" in line and str(server.port) in line]
    assert len(about_server) == 1, about_server
    done = record(run_dir)
    assert done["status"] == "completed"
    assert done["mlflow"]["missed"]["points"] > 0 and server.uri == done["mlflow"]["tracking_uri"]
    assert [step for step, _ in points(run_dir)["train/loss"]][-1] == 60  # TensorBoard's points: every one


@pytest.mark.slow
def test_kill9_then_resume_continues_the_same_mlflow_run_without_repeating_a_step(server, tmp_path):
    args = [
        *DIGITS,
        "logger=[tensorboard,mlflow]",
        f"logger.mlflow.tracking_uri={server.uri}",
        "logger.mlflow.experiment=resume",
        "trainer.max_steps=60",
        "trainer.log_every=2",
        "trainer.checkpoint.every=10",
        "+callbacks.paced._target_=tests.helpers.callbacks.Paced",
        "+callbacks.paced.seconds=0.1",
        "hydra.run.dir=run",
    ]
    run_dir, client = tmp_path / "run", server.client()
    proc = start(args, tmp_path)

    def logged_past_a_checkpoint() -> bool:
        steps = [step for step, _ in checkpoint.step_checkpoints(run_dir / "checkpoints")]
        return bool(steps) and last_step(run_dir) >= max(steps) + 4

    wait_for(logged_past_a_checkpoint)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert record(run_dir)["status"] == "running", "the run finished before it could be killed"
    first = run_id(run_dir)
    newest = max(step for step, _ in checkpoint.step_checkpoints(run_dir / "checkpoints"))
    before = [step for step, _ in history(client, first, "train/loss")]
    assert max(before) > newest  # steps the resumed run takes again were in MLflow already

    result = run([*args, "trainer.resume=auto"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_id(run_dir) == first
    experiment = client.get_experiment_by_name("resume")
    assert len(client.search_runs([experiment.experiment_id])) == 1
    got = client.get_run(first)
    assert got.info.status == "FINISHED"
    for tag, series in points(run_dir).items():
        steps = [step for step, _ in history(client, first, tag)]
        assert steps == sorted(set(steps)), f"{tag}: a step logged twice"
        assert steps == [step for step, _ in series], tag
    assert record(run_dir)["mlflow"]["points_sent_before_resume"] > 0


def test_a_tracking_uri_mlflow_cannot_use_stops_the_run_before_training(ortflow_cli, tmp_path):
    status, err = ortflow_cli(
        *DIGITS,
        "logger=[tensorboard,mlflow]",
        "logger.mlflow.tracking_uri=htp://nowhere",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert status != 0
    assert "logger.mlflow" in err and "htp://nowhere" in err and "required=false" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


def test_an_unusable_uri_with_tracking_optional_trains_without_mlflow(ortflow_cli, tmp_path):
    status, err = ortflow_cli(
        *DIGITS,
        "logger=[tensorboard,mlflow]",
        "logger.mlflow.tracking_uri=htp://nowhere",
        "logger.mlflow.required=false",
        "trainer.max_steps=5",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert status == 0, err[-3000:]
    log = (tmp_path / "run" / "ortflow.log").read_text()
    assert [line for line in log.splitlines() if "WARNING" in line and "htp://nowhere" in line]
    assert record(tmp_path / "run")["status"] == "completed"


@pytest.mark.slow
def test_without_a_uri_the_run_goes_to_a_local_store_under_outputs(ortflow_cli, tmp_path):
    status, err = ortflow_cli(
        *DIGITS, "logger=[tensorboard,mlflow]", "trainer.max_steps=5", "hydra.run.dir=run", cwd=tmp_path
    )
    assert status == 0, err[-3000:]
    from mlflow.tracking import MlflowClient

    store = tmp_path / "outputs" / "mlflow.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    got = client.get_run(run_id(tmp_path / "run"))
    assert got.info.status == "FINISHED" and got.data.metrics["engine/ort_executed"] == 0.0
    assert got.info.artifact_uri.startswith((tmp_path / "outputs" / "mlartifacts").as_uri())
    assert "run.json" in {a.path for a in client.list_artifacts(got.info.run_id)}


def test_a_server_down_at_start_costs_one_warning_and_the_run_completes(ortflow_cli, tmp_path):
    from tests.helpers.mlflow_server import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    status, err = ortflow_cli(
        *DIGITS,
        "logger=[tensorboard,mlflow]",
        f"logger.mlflow.tracking_uri={uri}",
        "trainer.max_steps=10",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert status == 0, err[-3000:]
    log = (tmp_path / "run" / "ortflow.log").read_text().splitlines()
    assert len([line for line in log if "WARNING" in line and uri in line]) == 1
    done = record(tmp_path / "run")
    assert done["status"] == "completed" and done["mlflow"]["run_id"] is None
    final = [k for k, v in done["metrics"].items() if isinstance(v, float)]  # sent as final/<name>
    assert done["mlflow"]["missed"]["points"] == sum(len(s) for s in points(tmp_path / "run").values()) + len(final)
    assert (tmp_path / "run" / "tensorboard").is_dir()


@pytest.mark.slow
def test_an_optuna_sweep_is_a_parent_run_with_a_child_per_trial(server, tmp_path):
    sweep_dir = tmp_path / "sweep"
    where = [
        f"logger.mlflow.tracking_uri={server.uri}",
        "logger.mlflow.experiment=sweep",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    args = [*optuna_sweep(), *where]
    result = run(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    client = server.client()
    parent_id = json.loads((sweep_dir / "mlflow.json").read_text())["run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    experiment = client.get_experiment_by_name("sweep").experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    jobs = sorted(p for p in sweep_dir.iterdir() if (p / "run.json").is_file())
    assert len(jobs) == 4 and len(children) == 4
    by_id = {c.info.run_id: c for c in children}
    statuses = []
    for job in jobs:
        done = record(job)
        child = by_id[run_id(job)]
        statuses.append(done["status"])
        # Its overrides as params (the trial's learning rate), its objective, pruned ones marked.
        lr = next(o.split("=", 1)[1] for o in done["overrides"] if o.startswith("optim.lr="))
        assert float(child.data.params["optim.lr"]) == pytest.approx(float(lr))
        assert child.data.metrics["objective"] == pytest.approx(done["metrics"]["eval/loss"])
        assert (child.data.tags.get("pruned") == "true") == (done["status"] == "pruned")
    assert "pruned" in statuses and "completed" in statuses, statuses  # the sweep pruned a trial
    # The best trial, tagged on the parent: the completed job with the lowest eval/loss.
    best = min((j for j in jobs if record(j)["status"] == "completed"), key=lambda j: record(j)["metrics"]["eval/loss"])
    assert parent.data.tags["best_job"] == best.name
    assert parent.data.tags["best_run_id"] == run_id(best)
    assert parent.data.metrics["best_objective"] == pytest.approx(record(best)["metrics"]["eval/loss"])
    assert "summary.csv" in {a.path for a in client.list_artifacts(parent_id)}
    # The sweep run again in its dir (the study continued to 5 trials): the same parent, one more child.
    again = run([*optuna_sweep(trials=5), *where], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((sweep_dir / "mlflow.json").read_text())["run_id"] == parent_id
    assert client.get_run(parent_id).info.status == "FINISHED"
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert len(children) == 5 and len(client.search_runs([experiment])) == 6


@pytest.mark.parametrize("required", [True, False])
def test_without_the_mlflow_package(required, ortflow_cli, monkeypatch, tmp_path):
    """Missing: a one-paragraph error naming the extra before any training, or with tracking optional a warning."""
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    args = [
        *DIGITS,
        "logger=[tensorboard,mlflow]",
        f"logger.mlflow.required={str(required).lower()}",
        "trainer.max_steps=5",
    ]
    status, err = ortflow_cli(*args, "hydra.run.dir=run", cwd=tmp_path)
    run_dir = tmp_path / "run"
    if required:
        assert status != 0 and "Traceback" not in err
        assert "logger.mlflow: the mlflow package is not installed" in err and "ortflow[mlflow]" in err
        assert not (run_dir / "metrics.jsonl").exists()
    else:
        assert status == 0, err[-3000:]
        log = (run_dir / "ortflow.log").read_text()
        assert "WARNING" in log and "the mlflow package is not installed" in log
        assert record(run_dir)["status"] == "completed" and "mlflow" not in record(run_dir)


@pytest.mark.slow
def test_under_ddp_only_rank_0_logs(server, tmp_path):
    args = [
        *DIGITS,
        "distributed=ddp",
        "trainer.max_steps=10",
        "trainer.log_every=2",
        "logger=[tensorboard,mlflow]",
        f"logger.mlflow.tracking_uri={server.uri}",
        "logger.mlflow.experiment=ddp",
        "hydra.run.dir=run",
    ]
    result = run(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, client = tmp_path / "run", server.client()
    assert record(run_dir)["engine"]["world_size"] == 2
    runs = client.search_runs([client.get_experiment_by_name("ddp").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id(run_dir)]
    for tag, series in points(run_dir).items():
        assert [step for step, _ in history(client, run_id(run_dir), tag)] == [step for step, _ in series], tag
