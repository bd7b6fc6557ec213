"""A real MLflow tracking server on loopback for the tests (`mlflow server`, a sqlite store and an artifact folder in
a temporary directory), started as a subprocess, waited for until it answers, and stopped."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MLflowServer:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        command = [
            *(sys.executable, "-m", "mlflow", "server"),
            *("--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"),
            *("--default-artifact-root", str(folder / "artifacts")),
            *("--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"),
        ]
        self.log = (folder / "server.log").open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(folder)

    def _wait(self, folder: Path, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not answer: {(folder / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """The server and the workers it started (its process group)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def optuna_sweep(trials: int = 4) -> list[str]:
    """`ortflow -m` arguments of an Optuna sweep of the digits recipe (one trial pruned after the first) that logs to
    TensorBoard and MLflow. The caller adds logger.mlflow.tracking_uri, logger.mlflow.experiment and hydra.sweep.dir."""
    return [
        "-m",
        "+recipe=digits",
        "+hparams_search=optuna",
        f"hydra.sweeper.n_trials={trials}",
        "hydra.sweeper.pruner.n_startup_trials=1",
        "hydra.sweeper.params={optim.lr: {type: float, low: 1e-5, high: 1e-1, log: true}}",
        "trainer.max_steps=40",
        "trainer.eval_every=10",
        "logger.progress=false",
        "logger=[tensorboard,mlflow]",
    ]
