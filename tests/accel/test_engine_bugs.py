"""ortflow's own bugs are not dressed as model problems: a bug injected into ortflow's build or step code of each
engine (an object ortflow's code calls replaced by None, so that ortflow's own frame raises) leaves the engine as
itself, not as the one-paragraph model error, whatever its type; the command prints its traceback, says it is a bug
in ortflow, names the run dir and exits with 1. Known ORT limits keep their paragraph (test_engine_failures.py)."""

import json

import pytest
import torch

from ortflow.accel import artifacts, none
from ortflow.accel.graph import pipeline
from ortflow.errors import OrtflowError, origin
from tests.accel.test_vision_engines import images, make_engine
from tests.conftest import TINY, custom_model

# (engine, where the bug is, the module attribute ortflow's code calls, replaced by None)
BUGS = [
    ("none", "build", none, "WithLoss"),
    ("none", "step", none, "math"),
    ("ortmodule", "build", pipeline, "ops_in_order"),  # inside ORTModule's export: the graph pipeline's rewrites
    ("ortmodule", "step", none, "math"),  # its torch.optim half
    ("artifacts", "build", pipeline, "ops_in_order"),
    ("artifacts", "step", artifacts, "_loss"),
]


def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 16 * 16, 10)
    )


@pytest.mark.parametrize(("kind", "where", "module", "name"), BUGS, ids=[f"{b[0]}-{b[1]}" for b in BUGS])
def test_a_bug_in_ortflows_code_keeps_its_type_and_says_where(kind, where, module, name, tmp_path, monkeypatch):
    (x, y), *_ = images(1)
    monkeypatch.setattr(module, name, None)
    with pytest.raises(Exception) as raised:
        engine = make_engine(kind, cnn(), (x, y), tmp_path)
        engine.train_step(x, y)
    assert not isinstance(raised.value, OrtflowError), raised.value
    assert origin(raised.value).kind == "ortflow" and origin(raised.value).file == module.__file__


def test_the_command_line_prints_the_bugs_traceback_names_the_run_dir_and_exits_1(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.setattr(artifacts, "_loss", None)
    args = [*custom_model("build_bigram"), *TINY[4:], "accel=artifacts", "hydra.run.dir=r"]
    status, stderr = ortflow_cli(*args, cwd=tmp_path)
    assert status == 1, stderr
    assert "Traceback (most recent call last)" in stderr and "ortflow/accel/artifacts.py" in stderr
    assert "this is a bug in ortflow" in stderr and "TypeError" in stderr and str(tmp_path / "r") in stderr
    assert "accel=ortmodule may train it" not in stderr  # no advice to switch engines
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["status"] == "failed" and "TypeError" in run["error"]
