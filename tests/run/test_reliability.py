"""Never silently wrong, nothing lost: non-finite gradients and evaluations, divergence, foreign and unwritable run
dirs, full disks, changed data, bad checkpoints, launch bounds, repeated Ctrl-C and the export check."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ortflow import files
from ortflow.errors import RunDirError
from ortflow.run import checkpoint
from ortflow.run.runner import build_data, build_engine, build_model
from ortflow.validate import problems
from tests.conftest import REPO, TINY, USER_ENV, make_cfg, run_cli
from tests.helpers import clusters

MODES = ["none", "ortmodule", "artifacts"]
INF_GRAD = [
    "model=custom",
    "model._target_=tests.helpers.faulty_models.build_infinite_gradient",
    "+model.vocab_size=256",
]
INF_GRAD += ["+model.width=16", *TINY[4:]]
NAN_EVAL = [*INF_GRAD[:1], "model._target_=tests.helpers.faulty_models.build_nan_in_eval", *INF_GRAD[2:]]
DIGITS = ["+recipe=digits", "trainer.max_steps=30", "trainer.log_every=5", "logger.progress=false"]


def strict_json(path: Path) -> dict:
    """run.json parsed as RFC 8259 JSON: the tokens NaN, Infinity and -Infinity are refused."""

    def refuse(token: str) -> None:
        raise ValueError(f"{path} holds the invalid JSON token {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_with_a_non_finite_norm_are_never_applied(mode, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    cfg = make_cfg(*INF_GRAD, f"accel={mode}")
    data = build_data(cfg)
    model = build_model(cfg, data)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = build_engine(cfg, model, data, tmp_path)
    x, y = next(iter(data.train))
    loss = engine.train_step(x, y)
    assert loss == pytest.approx(float(torch.log(torch.tensor(256.0))), rel=1e-5)  # finite: logits all zero
    assert not torch.isfinite(torch.tensor(engine.last_grad_norm))
    after = engine.model_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "an update with non-finite gradients was applied"


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_gradients_stop_the_run_before_any_checkpoint(mode, tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    status, stderr = ortflow_cli(
        *INF_GRAD, f"accel={mode}", "trainer.checkpoint.every=1", "hydra.run.dir=r", cwd=tmp_path
    )
    assert status == 2 and "The gradients became non-finite" in stderr and "at step 1" in stderr, stderr[-2000:]
    assert not checkpoint.step_checkpoints(tmp_path / "r" / "checkpoints")
    assert strict_json(tmp_path / "r" / "run.json")["status"] == "failed"


def test_with_skip_non_finite_gradients_are_skipped_then_the_run_stops_in_a_row(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    args = [*INF_GRAD, "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=3", "hydra.run.dir=r"]
    status, stderr = ortflow_cli(*args, cwd=tmp_path)
    assert status == 2 and "NaN/inf for 4 steps in a row" in stderr, stderr[-2000:]
    points = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert any(p.get("train/skipped_steps") == 2 for p in points)


def test_a_learning_rate_that_makes_the_loss_diverge_is_stopped_naming_it(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(*DIGITS, "optim.lr=10", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and "diverging" in stderr and "optim.lr=10.0" in stderr, stderr[-2000:]
    record = strict_json(tmp_path / "r" / "run.json")
    assert record["status"] == "failed" and record["error"].startswith("TrainingDiverged")
    # the same recipe at its own learning rate is not stopped
    status, stderr = ortflow_cli(*DIGITS, "hydra.run.dir=ok", cwd=tmp_path)
    assert status == 0, stderr[-2000:]


def test_a_nan_evaluation_stops_the_run_and_with_skip_is_recorded_as_null(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    status, stderr = ortflow_cli(*NAN_EVAL, "hydra.run.dir=stop", cwd=tmp_path)
    assert status == 2 and "The evaluation at step 3 gave" in stderr, stderr[-2000:]
    status, stderr = ortflow_cli(*NAN_EVAL, "trainer.on_nonfinite=skip", "hydra.run.dir=skip", cwd=tmp_path)
    assert status == 0, stderr[-2000:]
    record = strict_json(tmp_path / "skip" / "run.json")
    assert record["status"] == "completed" and record["metrics"]["eval/loss"] is None
    assert not (tmp_path / "skip" / "checkpoints" / "best.pt").exists()  # no evaluation was usable
    for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda token: pytest.fail(f"metrics.jsonl holds {token}"))


def test_a_directory_with_other_files_is_refused_by_the_command_and_left_untouched(tmp_path, ortflow_cli):
    mine = tmp_path / "mine"
    (mine / "onnx").mkdir(parents=True)
    (mine / "onnx" / "forward.onnx").write_bytes(b"a user's own model")
    status, stderr = ortflow_cli(*DIGITS, "accel=artifacts", f"hydra.run.dir={mine}", cwd=tmp_path)
    assert status == 2 and "holds files that ortflow did not write" in stderr, stderr[-2000:]
    assert sorted(p.name for p in mine.rglob("*")) == ["forward.onnx", "onnx"]
    assert (mine / "onnx" / "forward.onnx").read_bytes() == b"a user's own model"


def test_an_unwritable_run_dir_is_a_clear_error(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(*DIGITS, "hydra.run.dir=/proc/ortflow-run", cwd=tmp_path)
    assert status == 2 and "cannot create the run dir '/proc/ortflow-run'" in stderr and "Traceback" not in stderr


def test_an_unquoted_non_ascii_run_dir_is_named_with_the_quoting_that_works(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(*DIGITS, "hydra.run.dir=outputs/été", cwd=tmp_path)
    assert status == 2 and """'hydra.run.dir="outputs/été"'""" in stderr, stderr
    status, stderr = ortflow_cli(*DIGITS, 'hydra.run.dir="outputs/été"', "trainer.max_steps=2", cwd=tmp_path)
    assert status == 0 and (tmp_path / "outputs" / "été" / "run.json").is_file(), stderr[-2000:]


def test_a_batch_larger_than_the_split_is_refused_and_the_dir_stays_usable(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(*DIGITS, "data.batch_size=5000", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and "data.batch_size=5000" in stderr and "1347 samples" in stderr, stderr[-2000:]
    assert "Traceback" not in stderr
    status, stderr = ortflow_cli(*DIGITS, "trainer.max_steps=2", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 0, stderr[-2000:]


def test_a_checkpoint_of_random_bytes_is_refused_without_unsafe_advice(tmp_path, ortflow_cli):
    (tmp_path / "random.pt").write_bytes(os.urandom(4096))
    status, stderr = ortflow_cli(*DIGITS, f"trainer.resume={tmp_path / 'random.pt'}", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and "random.pt' cannot be read" in stderr, stderr[-2000:]
    assert "weights_only" not in stderr and "arbitrary code" not in stderr


def test_resuming_on_changed_data_is_refused_unless_allowed(tmp_path, ortflow_cli):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    base = [*TINY, f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "hydra.run.dir=r"]
    status, stderr = ortflow_cli(*base, "trainer.max_steps=2", "trainer.checkpoint.every=2", cwd=tmp_path)
    assert status == 0, stderr[-2000:]
    assert strict_json(tmp_path / "r" / "run.json")["data_identity"]["fingerprint"]
    corpus.write_text("a different corpus, the same size or not. " * 400)
    status, stderr = ortflow_cli(*base, "trainer.resume=auto", cwd=tmp_path)
    assert status == 2 and "was trained on other data" in stderr and "trainer.allow_data_change" in stderr, stderr
    status, stderr = ortflow_cli(*base, "trainer.resume=auto", "trainer.allow_data_change=true", cwd=tmp_path)
    assert status == 0, stderr[-2000:]


def test_more_processes_than_cores_are_refused_before_any_starts():
    found = problems(make_cfg("distributed=ddp", "distributed.nproc_per_node=100000"))
    assert any("distributed.nproc_per_node=100000 is more than this machine's" in p for p in found), found


# ------------------------------------------------------------------------------------------------ full disks
def test_a_write_that_fails_for_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "run.json"
    files.write_json_atomic(path, {"status": "running"})

    def full(_file) -> None:
        _file.write(b'{"status": "')
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RunDirError, match="the disk is full"):
        files.write_atomic(path, full)
    assert json.loads(path.read_text()) == {"status": "running"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_torch_s_writer_failing_mid_file_is_named_and_leaves_nothing(tmp_path):
    """torch.save reports a refused write as its own RuntimeError ("unexpected pos ..."); the file system's reason is
    what the user must read. A file-size limit makes the kernel refuse the write for real (in a child process)."""
    code = f"""
import resource, signal, torch
from pathlib import Path
from ortflow.run import checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    checkpoint.write_atomic({{"w": torch.zeros(100000)}}, Path({str(tmp_path / "step-00000001.pt")!r}))
except Exception as err:
    print(type(err).__name__, err)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("RunDirError cannot write"), result.stdout + result.stderr[-2000:]
    assert "the file is larger than this process may write" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_json_is_written_as_rfc_8259_json(tmp_path):
    files.write_json_atomic(
        tmp_path / "x.json", {"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}}
    )
    assert strict_json(tmp_path / "x.json") == {"a": None, "b": [None, 1.5], "c": {"d": None}}


@pytest.fixture
def small_disk(tmp_path):
    """A 600 KB tmpfs (root only): the run dir of a run that fills it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_disk_that_fills_during_a_run_is_named_and_leaves_only_complete_files(mode, small_disk, tmp_path):
    args = [*DIGITS, f"accel={mode}", "trainer.checkpoint.every=1", "trainer.checkpoint.keep=null"]
    result = run_cli(*args, f"hydra.run.dir={small_disk / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the disk is full (No space left on device)" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("Logging error") == 0 and len(result.stderr.splitlines()) <= 3, result.stderr
    assert not [p for p in small_disk.rglob("*") if ".tmp" in p.name or p.suffix == ".saving"]
    for _, path in checkpoint.step_checkpoints(small_disk / "run" / "checkpoints"):
        checkpoint.load(path)  # every checkpoint under its final name is complete
    assert strict_json(small_disk / "run" / "run.json")["status"] in ("failed", "running")


# ------------------------------------------------------------------------------------------ processes, signals
@pytest.mark.slow
def test_nodes_that_never_come_end_the_launch_with_the_reason(tmp_path):
    args = [*TINY, "distributed=ddp", "distributed.nnodes=2", "distributed.nproc_per_node=1"]
    args += ["distributed.rdzv_timeout_s=2", "distributed.rdzv_endpoint=127.0.0.1:29731", "hydra.run.dir=node0"]
    started = time.monotonic()
    result = run_cli(*args, cwd=tmp_path, timeout=240)
    assert result.returncode != 0 and time.monotonic() - started < 200
    assert "did not all join the rendezvous at 127.0.0.1:29731 within distributed.rdzv_timeout_s=2" in result.stderr


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid (Linux: /proc/PID/stat), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, parent = stat[stat.rindex(")") + 2 :].split()[:2]
    return state, int(parent)


def _alive(pid: int) -> bool:
    found = _state_and_parent(pid)
    return found is not None and found[0] != "Z"  # a zombie has ended, waiting to be reaped


def _wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_processes_ortflow_starts_end_when_it_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer.max_steps=100000", "distributed=ddp", f"hydra.run.dir={run_dir}"]
    parent = subprocess.Popen([sys.executable, "-m", "ortflow", *args], cwd=tmp_path, stderr=subprocess.DEVNULL)
    _wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0)
    started = clusters.descendants(parent.pid, alive_only=True)
    assert len(started) >= 3  # the rank fork server and its 2 ranks
    parent.kill()
    parent.wait()
    _wait_for(lambda: not [pid for pid in started if _alive(pid)], timeout=60)


@pytest.mark.slow
def test_a_second_ctrl_c_exits_130_and_the_record_says_interrupted(tmp_path):
    args = [*TINY, "trainer.max_steps=100000", "trainer.log_every=1", "hydra.run.dir=run"]
    # Its output goes to files, not pipes: a line every step would fill a pipe nobody reads until the signals are sent.
    log = tmp_path / "stderr.txt"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ortflow", *args], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        _wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").is_file())
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, log.read_text()[-2000:]
    assert strict_json(tmp_path / "run" / "run.json")["status"] == "interrupted"


# ------------------------------------------------------------------------------------------------------ export
def test_an_export_that_differs_from_torch_beyond_the_tolerance_fails_the_run(tmp_path, ortflow_cli):
    args = [*DIGITS, "export.onnx=true", "export.tolerance=1e-12", "hydra.run.dir=r"]
    status, stderr = ortflow_cli(*args, cwd=tmp_path)
    assert status == 2 and "more than export.tolerance=1e-12" in stderr, stderr[-2000:]
    assert not (tmp_path / "r" / "model.onnx").exists()
    assert strict_json(tmp_path / "r" / "run.json")["status"] == "failed"


@pytest.mark.slow
def test_the_export_check_compares_eval_mode_outputs_of_a_model_with_dropout(tmp_path):
    args = [
        "+recipe=transformer",
        "trainer.max_steps=5",
        "export.onnx=true",
        "logger.progress=false",
        "hydra.run.dir=r",
    ]
    result = run_cli(*args, cwd=tmp_path, env=USER_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    record = strict_json(tmp_path / "r" / "run.json")["export"]
    assert (
        record["max_abs_diff"] < 1e-4 <= record["tolerance"]
    )  # dropout 0.1: a training-mode reference differed by 0.5
