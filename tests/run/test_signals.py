"""SIGTERM and SIGINT at several moments of a run (start-up, export, a training step, eval, checkpoint writing), in
the accel modes where that moment exists: run.json always says what happened (never left at "running"), the exit
status is the documented one, and no partial checkpoint is left visible."""

import json
import os
import signal

import pytest

from ortflow.run import checkpoint
from ortflow.run.signals import interrupt_on_signals
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


def test_a_ctrl_c_while_a_run_puts_the_handlers_back_reaches_the_callers_handler(monkeypatch):
    """A signal landing while interrupt_on_signals puts the caller's handlers back (a notebook's Ctrl-C at the end
    of ortflow.train) waits until they are back, and goes to them: neither is left ignored."""
    got: list[int] = []
    caller = signal.signal(signal.SIGINT, lambda signum, _frame: got.append(signum))
    real = signal.signal
    sent: list[bool] = []

    def restoring(sig, handler):  # Ctrl-C arrives as the first handler goes back
        if sig == signal.SIGTERM and handler is not signal.SIG_IGN and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return real(sig, handler)

    try:
        with interrupt_on_signals():
            monkeypatch.setattr(signal, "signal", restoring)
        monkeypatch.setattr(signal, "signal", real)
        assert got == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    finally:
        real(signal.SIGINT, caller)
