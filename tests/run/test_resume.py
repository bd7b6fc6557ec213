"""Checkpoints and resume: kill -9 at a random step then resume equals an uninterrupted run; SIGTERM checkpoints and
exits cleanly; checkpoints convert between accel modes; NaN guards; a run dir is never written over."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ortflow.run import checkpoint
from tests.conftest import REPO, TINY, custom_model, run_cli

# Long enough (hundreds of steps) to be killed mid-run, small enough to take seconds per run.
LONG = [
    *TINY[:4],
    *TINY[4:6],
    "trainer.max_steps=200",
    "trainer.eval_every=50",
    "trainer.eval_batches=2",
    "trainer.log_every=10",
    "trainer.checkpoint.every=10",
    "trainer.checkpoint.keep=3",
    "scheduler=cosine",
    "scheduler.warmup_steps=20",
    "logger.progress=false",
]
# Measured: resumed ORT runs match the uninterrupted ones bit for bit too (ORT's dropout is re-seeded per step);
# the stated tolerance for ORT modes leaves room for kernels that sum in a thread-dependent order.
RTOL_ORT = 1e-6
# What each engine's record says executed it (its own counters: ORT's runs, inductor's compiled graphs' runs).
EXECUTED_BY = {"none": "pytorch", "ortmodule": "onnxruntime", "artifacts": "onnxruntime", "compile": "inductor"}


# accel=compile's kernels are not bit-reproducible from run to run on every CPU with more than one thread: on a 2-core
# Intel Xeon (AMX) two uninterrupted runs of LONG differed by up to 6e-4 in a weight, and were bit-equal on one
# thread (on the Zen 5s it was bit-equal on two). What these tests check is the resume (checkpoint, RNG, data
# position), so compile's runs take one thread; docs/engines.md says it for users.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def thread_env(accel: str) -> dict[str, str] | None:
    return ONE_THREAD if accel == "compile" else None


def start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ortflow", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(condition, timeout: float = 300, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)


def assert_same_run(resumed: Path, reference: Path, rtol: float) -> float:
    """Final metrics and weights agree (exactly when rtol=0); returns the largest relative difference."""
    got, want = record(resumed)["metrics"], record(reference)["metrics"]
    worst = 0.0
    for key in ("train/loss", "eval/loss", "eval/accuracy"):
        worst = max(worst, abs(got[key] - want[key]) / abs(want[key]))
    a, b = final_weights(resumed), final_weights(reference)
    assert a.keys() == b.keys()
    for name in a:
        if a[name].is_floating_point():
            worst = max(worst, float(((a[name] - b[name]).abs() / b[name].abs().clamp_min(1e-6)).max()))
        else:
            assert torch.equal(a[name], b[name])
    assert worst <= rtol, f"resumed run differs from the uninterrupted one by {worst:.3g} (allowed {rtol})"
    return worst


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per accel mode, made on first use."""
    made: dict[str, Path] = {}

    def get(accel: str) -> Path:
        if accel not in made:
            cwd = tmp_path_factory.mktemp(f"reference-{accel}")
            result = run_cli(*LONG, f"accel={accel}", "hydra.run.dir=run", cwd=cwd, env=thread_env(accel))
            assert result.returncode == 0, result.stderr[-3000:]
            made[accel] = cwd / "run"
        return made[accel]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["none", "ortmodule", "artifacts", "compile"])
def test_kill9_at_a_random_step_then_resume_matches_an_uninterrupted_run(accel, reference, tmp_path):
    run_dir = tmp_path / "run"
    args = [*LONG, f"accel={accel}", "hydra.run.dir=run"]
    proc = start(args, tmp_path, thread_env(accel))
    # Killed a moment after a random checkpoint of the first half, so mid-step somewhere, before the run can end
    # however fast the machine.
    target = random.randrange(10, 100, 10)
    wait_for(
        lambda: any(step >= target for step, _ in checkpoint.step_checkpoints(run_dir / "checkpoints")), poll=0.005
    )
    time.sleep(random.uniform(0.0, 0.02))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert record(run_dir)["status"] == "running", "the run finished before it could be killed"
    written = checkpoint.step_checkpoints(run_dir / "checkpoints")
    for _, path in written:  # every checkpoint under its final name is complete and valid
        checkpoint.load(path)
    killed_after = written[0][0]
    print(f"{accel}: killed after checkpoint step {killed_after}")

    result = run_cli(*args, "trainer.resume=auto", cwd=tmp_path, env=thread_env(accel))
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = record(run_dir)
    assert resumed["status"] == "completed"
    assert resumed["resumed_from"]["step"] >= killed_after and resumed["resumed_from"]["optimizer_restored"]
    assert resumed["attempts"][0]["status"] == "running"  # the killed attempt is kept in the record
    assert resumed["engine"]["executed_by"] == EXECUTED_BY[accel]
    worst = assert_same_run(run_dir, reference(accel), 0.0 if accel in ("none", "compile") else RTOL_ORT)
    print(f"{accel}: largest relative difference to the uninterrupted run: {worst:.3g}")


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_exits_cleanly_then_resumes_exactly(reference, tmp_path):
    run_dir = tmp_path / "run"
    args = [*LONG, "hydra.run.dir=run"]
    proc = start(args, tmp_path)
    target = random.randrange(10, 100, 10)  # a random checkpoint of the first half, then a moment later
    wait_for(
        lambda: any(step >= target for step, _ in checkpoint.step_checkpoints(run_dir / "checkpoints")), poll=0.005
    )
    time.sleep(random.uniform(0.0, 0.02))
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    stopped = record(run_dir)
    assert stopped["status"] == "preempted"
    assert "trainer.resume=auto" in stderr
    step = checkpoint.step_checkpoints(run_dir / "checkpoints")[0][0]
    assert f"after step {step}" in stopped["error"]

    result = run_cli(*args, "trainer.resume=auto", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert record(run_dir)["resumed_from"]["step"] == step
    assert_same_run(run_dir, reference("none"), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target"), [("none", "ortmodule"), ("ortmodule", "artifacts"), ("artifacts", "none")]
)
def test_a_checkpoint_from_one_accel_mode_continues_in_another(source, target, tmp_path, ortflow_cli):
    """6 steps in one engine, 3 more in another from its checkpoint, against 9 steps in the second: the AdamW moments
    carried across (dropout off, so the engines compute the same steps). Each tensor's largest difference, relative
    to its largest weight, measured 0 to 2.4e-2 (eager and ORT round apart, and Adam turns near-zero gradients into
    whole steps); with the moments dropped at the resume it was 0.48 in every pair. Held to 0.1."""
    short = [*TINY, "trainer.checkpoint.every=3", "model.dropout=0"]
    status, stderr = ortflow_cli(*short, f"accel={source}", "hydra.run.dir=first", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    ckpt = tmp_path / "first" / "checkpoints" / "step-00000006.pt"
    status, stderr = ortflow_cli(
        *short, f"accel={target}", "trainer.max_steps=9", f"trainer.resume={ckpt}", "hydra.run.dir=second", cwd=tmp_path
    )
    assert status == 0, stderr[-3000:]
    info = record(tmp_path / "second")
    assert info["resumed_from"]["written_by_accel"] == source and info["resumed_from"]["step"] == 6
    assert info["resumed_from"]["optimizer_restored"]  # all three step torch's AdamW (optim.fused)
    assert info["engine"]["executed_by"] == ("pytorch" if target == "none" else "onnxruntime")
    status, stderr = ortflow_cli(*short, f"accel={target}", "trainer.max_steps=9", "hydra.run.dir=whole", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    got, want = final_weights(tmp_path / "second"), final_weights(tmp_path / "whole")
    floats = [k for k in want if want[k].is_floating_point()]
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in floats)
    assert worst < 0.1, f"the continued run is {worst:.3g} from the uninterrupted one: were the moments carried?"


def test_nan_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    model = custom_model("build_nan_at_step", nan_steps=[5])
    args = [*model, *TINY[4:], "trainer.checkpoint.every=2"]
    status, stderr = ortflow_cli(*args, "hydra.run.dir=stop", cwd=tmp_path)
    assert status == 2
    assert "at step 5" in stderr and "Traceback" not in stderr
    ckpts = [step for step, _ in checkpoint.step_checkpoints(tmp_path / "stop" / "checkpoints")]
    assert ckpts == [4, 2]
    assert record(tmp_path / "stop")["status"] == "failed"
    kept = checkpoint.load(tmp_path / "stop" / "checkpoints" / "step-00000004.pt")
    assert all(torch.isfinite(w).all() for w in kept["model"].values())

    status, stderr = ortflow_cli(*args, "trainer.on_nonfinite=skip", "hydra.run.dir=skip", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    assert record(tmp_path / "skip")["metrics"]["skipped_steps"] == 1
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path / "skip").values())

    many = custom_model("build_nan_at_step", nan_steps=[2, 3, 4])
    skip_two = ["trainer.on_nonfinite=skip", "trainer.max_skipped_steps=2"]
    status, stderr = ortflow_cli(*many, *TINY[4:], *skip_two, cwd=tmp_path)
    assert status == 2 and "trainer.max_skipped_steps=2" in stderr


def test_a_new_run_never_writes_into_a_dir_that_holds_one(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(*TINY, "hydra.run.dir=run", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    status, stderr = ortflow_cli(*TINY, "optim.lr=0.1", "hydra.run.dir=run", cwd=tmp_path)
    assert status == 2 and "trainer.resume=auto" in stderr
    after = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["none", "ortmodule", "artifacts"])
def test_a_run_writes_nothing_outside_its_run_dir(accel, tmp_path):
    home, tmp, work = tmp_path / "home", tmp_path / "tmp", tmp_path / "work"
    for d in (home, tmp, work):
        d.mkdir()
    # torch (2.14) makes its compile cache's folder when torch._dynamo is imported (torch.optim imports it), and sets
    # TORCHINDUCTOR_CACHE_DIR in that process: given here, the test is the same alone as after a test that did so.
    env = {"HOME": str(home), "TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch-cache")}
    result = run_cli(*TINY, f"accel={accel}", "hydra.run.dir=run", cwd=work, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in work.iterdir()] == ["run"]
    assert list(home.rglob("*")) == [] and list(tmp.rglob("*")) == []
