"""SIGTERM and SIGINT at several moments of a run (start-up, export, a training step, eval, checkpoint writing), in
the accel modes where that moment exists: run.json always says what happened (never left at "running"), the exit
status is the documented one, and no partial checkpoint is left visible."""

import json

import pytest

from ortflow.run import checkpoint
from tests.conftest import TINY, USER_ENV, custom_model, run_cli

# (moment, signal, accel mode) -> (exit status, run.json status)
CASES = [
    ("start-up", "SIGTERM", "none", 143, "interrupted"),
    ("start-up", "SIGINT", "ortmodule", 130, "interrupted"),
    ("export", "SIGTERM", "artifacts", 143, "interrupted"),  # artifacts export before the loop
    ("export", "SIGTERM", "ortmodule", 0, "preempted"),  # ORTModule exports inside the first step
    ("train", "SIGTERM", "none", 0, "preempted"),
    ("train", "SIGINT", "none", 130, "interrupted"),
    ("eval", "SIGTERM", "none", 0, "preempted"),
    ("checkpoint", "SIGTERM", "none", 0, "preempted"),
    ("checkpoint", "SIGINT", "artifacts", 130, "interrupted"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("moment", "sig", "accel", "exit_status", "status"), CASES)
def test_a_signal_at_any_moment_is_recorded(moment, sig, accel, exit_status, status, tmp_path):
    args = [
        *custom_model("build_signal_at", moment=moment, sig=sig),
        *TINY[4:],
        "trainer.checkpoint.every=2",
        f"accel={accel}",
        "hydra.run.dir=run",
    ]
    result = run_cli(*args, cwd=tmp_path, env=USER_ENV)
    assert result.returncode == exit_status, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == status and sig in record["error"]
    ckpts = tmp_path / "run" / "checkpoints"
    assert not list(ckpts.glob(".*")), "a partial checkpoint is visible"
    for _, path in checkpoint.step_checkpoints(ckpts):
        checkpoint.load(path)
    if status == "preempted":
        assert "trainer.resume=auto" in result.stderr
    if moment in ("start-up", "export") and status == "interrupted":  # never trained: the dir may be reused
        again = run_cli(*TINY, "hydra.run.dir=run", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
