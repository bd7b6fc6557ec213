"""The loop's callbacks (ortflow/run/callbacks.py): a user's own, named in the config by `_target_`, called at the
loop's phases with the loop, able to stop the run (which then ends as `callback` with its checkpoint); a callback the
config cannot build is refused naming its key, before anything trains."""

import json

import pytest
import torch

from tests.helpers.callbacks import StopAt

TARGET = "tests.helpers.callbacks.StopAt"


def record(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def test_a_users_callback_is_called_at_each_phase_and_stops_the_run(tmp_path, ortflow_cli):
    StopAt.seen.clear()
    args = ["+recipe=digits", "trainer.max_steps=60", "trainer.eval_every=10", "trainer.checkpoint.every=0"]
    callback = [f"+callbacks.stop_at._target_={TARGET}", "+callbacks.stop_at.accuracy=0.3"]
    status, stderr = ortflow_cli(*args, *callback, "hydra.run.dir=r", cwd=tmp_path)
    assert status == 0, stderr[-2000:]
    run = record(tmp_path / "r")
    steps = run["metrics"]["steps"]
    assert run["ended_by"] == "callback" and steps < 60 and steps % 10 == 0
    assert StopAt.seen[0] == ("start", 0) and StopAt.seen[-1] == ("end", steps)
    assert [s for m, s in StopAt.seen if m == "step"] == list(range(1, steps + 1))
    assert [s for m, s in StopAt.seen if m == "evaluation"] == list(range(10, steps + 1, 10))
    assert ("best", 10) in StopAt.seen
    final = torch.load(tmp_path / "r" / "checkpoints" / "final.pt", weights_only=True)
    last = torch.load(next((tmp_path / "r" / "checkpoints").glob("step-*.pt")), weights_only=False)
    assert last["loop"]["stopped_by_callback_at"] == steps  # its checkpoint written at the step it stopped
    assert final.keys() == last["model"].keys()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["+callbacks.mine.accuracy=0.5"], "callbacks.mine must name a class with _target_"),
        (["+callbacks.mine._target_=tests.helpers.callbacks.Missing"], "callbacks.mine: tests.helpers.callbacks.Mis"),
        ([f"+callbacks.mine._target_={TARGET}"], "could not be built"),  # its argument missing
        (["+callbacks.mine._target_=tests.helpers.callbacks.NotACallback"], "none of a callback's methods"),
    ],
    ids=["no-target", "unknown-class", "missing-argument", "not-a-callback"],
)
def test_a_callback_the_config_cannot_build_is_refused_naming_its_key(given, said, tmp_path, ortflow_cli):
    status, stderr = ortflow_cli("+recipe=digits", *given, "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and said in stderr, stderr[-2000:]
    assert record(tmp_path / "r")["stage"] == "starting"  # refused before anything trained
