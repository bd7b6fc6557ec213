"""Shared fixtures: compose configs in-process, shrink every run, run the CLI in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ortflow.accel.compat import inductor
from ortflow.api import register_configs
from ortflow.paths import config_dir
from tests.helpers import zygote

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# The transformer at its smallest that still has every kind of layer (attention, feed-forward, dropout, norms).
TINY_TRANSFORMER = [
    "model.d_model=32",
    "model.nhead=2",
    "model.num_layers=1",
    "model.dim_feedforward=64",
    "data.block_size=16",
    "data.batch_size=8",
]
# A run small enough for seconds on 2 CPU cores, still through every part of the loop (log, eval, partial batch).
TINY = [
    *TINY_TRANSFORMER,
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "trainer.eval_batches=3",
    "trainer.log_every=2",
    "scheduler.warmup_steps=2",
    "logger.progress=false",
]

register_configs()

# Tests run side by side (pytest-xdist): each worker takes its share of the cores, for torch, for ORT (which uses as
# many threads as torch) and for the processes it starts, so the workers do not oversubscribe the machine.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)
    # inductor's compile workers too (one per core otherwise, each importing torch while the tests' steps run)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(THREADS)
    if "torch._inductor.config" in sys.modules:
        sys.modules["torch._inductor.config"].compile_threads = THREADS


def make_cfg(*overrides: str) -> DictConfig:
    """Compose the config exactly as the CLI would, in-process."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _forks(env: dict[str, str] | None) -> bool:
    """Whether a command with these extra environment variables can be forked (tests/helpers/zygote.py)."""
    return set(env or {}) <= zygote.HONOURED and not os.environ.get("FRESH_INTERPRETERS")


def run_cli(*args: str, cwd: Path, timeout: int = 600, env: dict[str, str] | None = None):
    """Run `python -m ortflow ARGS` from `cwd` (not the checkout) and capture its output. The process is forked from
    a server that has the imports done (tests/helpers/zygote.py), unless `env` sets variables only a fresh interpreter
    honours or FRESH_INTERPRETERS is set in the environment."""
    full_env = {**os.environ, **(env or {})}
    if _forks(env):
        return zygote.fork_cli(list(args), cwd, full_env, timeout)
    return subprocess.run(
        [sys.executable, "-m", "ortflow", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def start_cli(*args: str, cwd: Path, env: dict[str, str] | None = None):
    """`python -m ortflow ARGS` started and returned at once (several run side by side): `.communicate(timeout)`
    gives (stdout, stderr) and sets `.returncode`. Forked like run_cli's commands, on the same conditions."""
    full_env = {**os.environ, **(env or {})}
    if _forks(env):
        return zygote.Forked(list(args), cwd, full_env)
    return subprocess.Popen(
        [sys.executable, "-m", "ortflow", *args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# Lets a subprocess import tests.helpers.user_model (a user's own model module).
USER_ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def custom_model(builder: str, **kwargs) -> list[str]:
    """Overrides for model=custom with a builder from tests/helpers/user_model.py (a bigram model of width 16)."""
    extra = [f"+model.{key}={value}" for key, value in kwargs.items()]
    return [
        "model=custom",
        f"model._target_=tests.helpers.user_model.{builder}",
        "+model.vocab_size=256",
        "+model.width=16",
        *extra,
    ]


def run_dirs(root: Path) -> list[Path]:
    """Run directories (those holding a run.json or a .hydra folder) under root/outputs."""
    return sorted(p.parent for p in (root / "outputs").rglob(".hydra"))


@pytest.fixture
def tiny() -> list[str]:
    return list(TINY)


@pytest.fixture
def ortflow_cli(monkeypatch, capfd):
    """Run the `ortflow` command line in this process (no interpreter start-up, no torch import: ~20x faster than a
    subprocess for runs that stop at a config, data or checkpoint error). Returns (exit status, stderr)."""
    from hydra.core.global_hydra import GlobalHydra

    from ortflow.cli import train as cli

    def run(*args: str, cwd: Path) -> tuple[int, str]:
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", ["ortflow", *args])
        GlobalHydra.instance().clear()
        capfd.readouterr()
        try:
            cli.main()
            status = 0
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            GlobalHydra.instance().clear()
        return status, capfd.readouterr().err

    return run


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--launches",
        type=int,
        default=5,
        help="two-rank launches the launch stress test runs under CPU load (tests/run/test_launch.py; 30 to stress)",
    )


COMPILE_REFUSED = inductor.unverified_torch()  # why accel=compile is refused on the installed torch, or None
REFUSAL_TEST = "test_accel_compile_is_refused_on_a_torch_outside_its_verified_range"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The end-to-end runs (`slow`) first, the quick tests after them: the workers then finish together instead of
    one running a long test while the others have run out of work. The order is the same in every worker (stable).
    It needs xdist to hand out few tests at a time (`--maxschedchunk=2`, the Makefile's XDIST): by default each
    worker first gets one block of consecutive tests, and the first worker's block held every slow test."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if COMPILE_REFUSED is not None:  # torch below accel=compile's verified range: its tests say why they do not run
        skip = pytest.mark.skip(reason=f"accel=compile is refused on this torch ({REFUSAL_TEST} checks it)")
        for item in items:
            if _runs_compile(item) and REFUSAL_TEST not in item.nodeid:
                item.add_marker(skip)


def _runs_compile(item: pytest.Item) -> bool:
    """A test that trains with accel=compile: a `compile` parameter, or a test of the engine itself."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    named = any(value == "compile" or str(value).endswith("-compile") for value in params.values())
    return named or "test_compile.py" in item.nodeid or "compiled_engine" in item.nodeid
