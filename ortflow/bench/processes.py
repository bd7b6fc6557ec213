"""Each measurement in its own process (ortflow.bench.worker), its output in the bench's log, and the signals that
stop the bench together with the measurement it is running."""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ortflow.bench.plan import Measurement, overrides_for

PARENT_ENV = "ORTFLOW_BENCH_PARENT"  # the bench's pid: the worker ends when that process does


def run_worker(args: argparse.Namespace, m: Measurement, log: Path) -> dict[str, Any]:
    """Measurement `m` in a fresh process whose output goes to `log`; its result, or {"error": ...}."""
    with tempfile.TemporaryDirectory(prefix="ortflow-bench-result-") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "ortflow.bench.worker", "--result", str(result_file)]
        cmd += ["--budget", str(args.budget), "--min-steps", str(args.min_steps), "--warmup", str(args.warmup)]
        cmd += [*(["--steps", str(args.steps)] if args.steps else []), *(["--profile"] if args.profile else [])]
        cmd += [m.mode, *overrides_for(args, m.setting)]
        env = os.environ | {PARENT_ENV: str(os.getpid())}
        with open(log, "ab") as out:
            out.write(f"\n==== measurement {m.index}: {m.label()} ({' '.join(cmd[2:])})\n".encode())
            out.flush()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
            out.write(f"==== pid {proc.pid}\n".encode())
            out.flush()
            try:
                code = proc.wait()
            except BaseException:  # the bench is being stopped: so is its measurement
                _stop(proc)
                raise
        with contextlib.suppress(OSError, ValueError):  # none, or cut short: the process was killed
            return json.loads(result_file.read_text())
    how = f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
    if code == -signal.SIGKILL:
        how += ": out of memory?"
    return {"mode": m.mode, "error": f"the measurement's process ended without a result ({how})"}


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Stopped(Exception):
    """SIGTERM (or SIGINT) arrived: the bench stops after killing its running measurement."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise Stopped, so that the running measurement's process is ended with the bench."""

    def stop(signum: int, frame: Any) -> None:
        restore()  # a second signal is not caught: the bench ends at once (its measurement with it, on Linux)
        raise Stopped(signum)

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        restore()
