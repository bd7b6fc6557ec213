"""The Python API: compose, train and load_run in this process, twice, with errors raised instead of exits; the
run-dir claim (lock, foreign and used dirs); the example notebook, executed."""

import logging
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

import ortflow
from ortflow.run.lock import LOCK_FILE, RunDirLock
from tests.conftest import REPO, TINY, start_cli

QUICK = ["+recipe=digits", "trainer.max_steps=20", "trainer.eval_every=10", "logger.progress=false"]


def test_import_ortflow_is_light_and_the_api_loads_on_first_use():
    code = "import sys, ortflow; print('torch' in sys.modules); print(ortflow.train.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "ortflow.api"]


def test_compose_returns_the_validated_config_the_command_line_would_use():
    cfg = ortflow.compose(["+recipe=digits", "accel=artifacts", "optim.lr=0.01"])
    assert isinstance(cfg, DictConfig)
    assert "hydra" not in cfg
    assert cfg.accel._target_ == "ortflow.accel.artifacts.build"
    assert cfg.optim.lr == 0.01
    assert not GlobalHydra.instance().is_initialized()


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["optim.lr=-1"], "optim.lr=-1.0: must be > 0"),
        (["trainer.max_step=3"], "trainer.max_step"),
        (["accel=foo"], "accel"),
        (["+recipe=no_such_recipe"], "no_such_recipe"),
    ],
)
def test_compose_raises_a_config_error_naming_the_key(overrides, says):
    with pytest.raises(ortflow.ConfigError, match=None) as err:
        ortflow.compose(overrides)
    assert says in str(err.value)
    assert not GlobalHydra.instance().is_initialized()


def test_a_malformed_recipe_in_a_config_dir_is_a_config_error_naming_the_file(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\ntrainer:\n\tmax_steps: 3\n")
    with pytest.raises(ortflow.ConfigError) as err:
        ortflow.compose(["+recipe=mine"], config_dir=tmp_path)
    assert "mine.yaml" in str(err.value)


def test_a_config_dir_adds_the_users_own_recipes(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - override /data: digits\n")
    assert ortflow.compose(["+recipe=mine", "model=mlp"], config_dir=tmp_path).data.batch_size == 64


def test_train_twice_in_one_process_returns_results_and_leaves_the_process_as_it_was(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    sigint, sigterm, showwarning = (
        signal.getsignal(signal.SIGINT),
        signal.getsignal(signal.SIGTERM),
        warnings.showwarning,
    )

    first = ortflow.train([*QUICK, "accel=artifacts"])
    second = ortflow.train(ortflow.compose([*QUICK, "accel=none"]), run_dir=tmp_path / "second")

    for result in (first, second):
        assert result.status == "completed"
        assert result.record["status"] == "completed"
        assert (result.run_dir / "run.json").is_file() and (result.run_dir / ".hydra" / "config.yaml").is_file()
        assert (result.run_dir / "ortflow.log").read_text().strip()
        assert result.metrics["eval/accuracy"] > 0.3  # 10 classes: well above chance after 20 steps
        assert result.metrics["best/step"] in (10, 20)
        assert not result.model.training
    assert first.record["engine"]["executed_by"] == "onnxruntime"
    assert first.record["engine"]["ort_train_steps"] == 20
    assert second.run_dir == tmp_path / "second"
    # The model holds the trained weights: ORT's (artifacts) copied back, identical to final.pt.
    final = torch.load(first.run_dir / "checkpoints" / "final.pt", weights_only=True)
    assert all(torch.equal(final[k], v) for k, v in first.model.state_dict().items())
    assert (root.handlers, root.level) == (handlers, level)
    assert signal.getsignal(signal.SIGINT) is sigint and signal.getsignal(signal.SIGTERM) is sigterm
    assert warnings.showwarning is showwarning
    assert not GlobalHydra.instance().is_initialized()


def test_load_run_gives_the_same_model_config_and_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trained = ortflow.train([*QUICK, "accel=none"], run_dir=tmp_path / "run")
    loaded = ortflow.load_run(tmp_path / "run")
    best = ortflow.load_run(tmp_path / "run", weights="best")
    x = torch.rand(5, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), trained.model(x))
        assert best.weights == "best" and best.model(x).shape == (5, 10)
    assert loaded.metrics == {k: v for k, v in trained.record["metrics"].items()}
    assert loaded.config.model._target_ == trained.config.model._target_


def test_load_run_of_a_dir_without_a_run_or_weights_is_a_clear_error(tmp_path):
    with pytest.raises(ortflow.RunDirError, match=r"holds no run\.json"):
        ortflow.load_run(tmp_path)
    with pytest.raises(ortflow.ConfigError, match="weights="):
        ortflow.load_run(tmp_path, weights="latest")


def test_train_raises_instead_of_exiting_on_a_used_dir_and_a_bad_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ortflow.train([*QUICK, "trainer.max_steps=2"], run_dir=tmp_path / "run")
    with pytest.raises(ortflow.RunDirError, match="already holds a run"):
        ortflow.train([*QUICK, "trainer.max_steps=2"], run_dir=tmp_path / "run")
    with pytest.raises(ortflow.ConfigError, match=r"optim\.lr"):
        ortflow.train([*QUICK, "optim.lr=0"], run_dir=tmp_path / "other")
    with pytest.raises(ortflow.ConfigError, match="not the string"):
        ortflow.train("+recipe=digits")


def test_a_directory_with_the_users_own_files_is_refused_and_left_untouched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    (mine / "onnx").mkdir(parents=True)
    (mine / "onnx" / "forward.onnx").write_bytes(b"my own model")
    (mine / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(mine) for p in mine.rglob("*"))
    with pytest.raises(ortflow.RunDirError, match=r"notes\.txt"):
        ortflow.train([*QUICK, "accel=artifacts"], run_dir=mine)
    assert sorted(p.relative_to(mine) for p in mine.rglob("*")) == before
    assert (mine / "onnx" / "forward.onnx").read_bytes() == b"my own model"


def test_an_unwritable_run_dir_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ortflow.RunDirError, match="cannot create the run dir '/proc/ortflow-run'"):
        ortflow.train(QUICK, run_dir="/proc/ortflow-run")


def test_a_run_dir_owned_by_another_process_is_refused_naming_its_pid_and_host(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    holder = RunDirLock.acquire(tmp_path / "run")  # another open file description: flock treats it as another owner
    try:
        with pytest.raises(
            ortflow.RunDirError, match=rf"in use by another ortflow process \(pid {os.getpid()} on host"
        ):
            ortflow.train(QUICK, run_dir=tmp_path / "run")
    finally:
        holder.release()
    assert ortflow.train([*QUICK, "trainer.max_steps=2"], run_dir=tmp_path / "run").status == "completed"


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
    code = (
        "import sys, time; from pathlib import Path; from ortflow.run.lock import RunDirLock; "
        "RunDirLock.acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(ortflow.RunDirError, match=f"pid {proc.pid}"):
        RunDirLock.acquire(tmp_path)
    proc.kill()
    proc.wait()
    lock = RunDirLock.acquire(tmp_path)  # kill -9 released it: no stale lock to clean up
    assert lock.held and str(os.getpid()) in (tmp_path / LOCK_FILE).read_text()
    lock.release()


@pytest.mark.slow
def test_runs_started_at_once_on_one_dir_train_one_at_a_time(tmp_path):
    """Several `ortflow` commands started together on one run dir: exactly one trains, every other one is refused
    before writing, naming the owner (or, when it started after the winner finished, the run already there)."""
    args = [*QUICK, "trainer.max_steps=30", "hydra.run.dir=run"]
    procs = [start_cli(*args, cwd=tmp_path, env={"PYTHONPATH": str(REPO)}) for _ in range(4)]
    stderrs = [p.communicate(timeout=300)[1] for p in procs]
    results = [(p.returncode, stderr) for p, stderr in zip(procs, stderrs, strict=True)]
    winners = [r for r in results if r[0] == 0]
    losers = [r for r in results if r[0] != 0]
    assert len(winners) == 1, results
    for status, stderr in losers:
        assert status == 2
        assert "in use by another ortflow process (pid " in stderr or "already holds a run" in stderr, stderr
    record = ortflow.load_run(tmp_path / "run").record
    assert record["status"] == "completed" and "attempts" not in record
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"step": 30' in line and "train/loss" in line for line in metrics) == 1  # one run's points only


@pytest.mark.slow
def test_the_example_notebook_runs(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}})
    client.execute(env={**os.environ, "PYTHONPATH": str(REPO)})
    outputs = "".join(
        o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    )
    assert "onnxruntime 100" in outputs
    assert "optim.lr=-1.0: must be > 0" in outputs
    assert len(list((tmp_path / "outputs").rglob("run.json"))) == 2
    assert Path(REPO / "examples" / "quickstart.ipynb").read_text().count('"outputs": []') > 0  # committed clean


def test_a_text_run_returns_its_tokenizer_and_load_run_rebuilds_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["+recipe=transformer", *TINY[:5], "trainer.max_steps=2", "logger.progress=false"]
    args += ["data.tokenizer=bpe", "data.bpe_vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}"]
    trained = ortflow.train(args, run_dir=tmp_path / "run")
    loaded = ortflow.load_run(tmp_path / "run")
    text = "The tokenizer the run trained with."
    for result in (trained, loaded):
        assert result.tokenizer.decode(result.tokenizer.encode(text)) == text
    assert loaded.tokenizer.encode(text) == trained.tokenizer.encode(text)
    assert len(trained.tokenizer.encode(text)) < len(text.encode())  # BPE tokens, not bytes
    assert trained.model.embedding.num_embeddings == 300  # the model followed the tokenizer's vocabulary
