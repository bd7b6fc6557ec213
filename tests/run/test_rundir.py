"""The run dir's owner in-process: checkpoint writing, pruning and partial writes, restore into a fresh engine,
attempt history, ranks other than 0; the per-rank overrides torchrun ranks get (how ortflow starts them:
tests/run/test_launch.py)."""

import json

import pytest
import torch

from ortflow.accel.engine import EngineContext
from ortflow.accel.none import build as build_eager
from ortflow.data.resumable import ResumableBatches
from ortflow.distributed import World
from ortflow.errors import OrtflowError
from ortflow.run import checkpoint
from ortflow.run.launch import rank_overrides
from ortflow.run.rundir import RunDir
from ortflow.run.trainer import LoopState
from tests.conftest import make_cfg

CFG = make_cfg()


def _engine(model):
    x = torch.randint(0, 256, (2, 4))
    return build_eager(EngineContext(model, (x, x), CFG.optim))


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))


def _batches():
    tokens = torch.arange(80).reshape(20, 4)
    data = torch.utils.data.TensorDataset(tokens, tokens + 1)
    gen = torch.Generator().manual_seed(0)
    return ResumableBatches(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, generator=gen))


def _open(path, resume=None, keep=2, world=None) -> RunDir:
    run = RunDir(path, {"seed": 0}, [], 0, world)
    run.open(resume, keep)
    return run


def test_checkpoints_are_pruned_to_keep_and_partial_writes_removed(tmp_path):
    run = _open(tmp_path)
    _, state = run.start(_model(), _engine, _batches(), max_steps=10)
    assert state is None and json.loads((tmp_path / "run.json").read_text())["status"] == "running"
    for step in (1, 2, 3):
        run.save(LoopState(step=step))
    assert [s for s, _ in checkpoint.step_checkpoints(tmp_path / "checkpoints")] == [3, 2]
    (tmp_path / "checkpoints" / ".step-00000004.pt.tmp-99").write_bytes(b"partial")
    again = _open(tmp_path, resume="auto")
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))
    assert again.source[0].name == "step-00000003.pt"


def test_a_resumed_run_gets_weights_optimizer_data_position_and_counters(tmp_path):
    run = _open(tmp_path)
    batches = _batches()
    engine, _ = run.start(_model(0), _engine, batches, max_steps=10)
    for _ in range(3):
        engine.train_step(*next(batches))
    run.save(LoopState(step=3, samples=6))
    expected_next = next(batches)[0]
    run.finish("failed", error="killed")

    resumed = _open(tmp_path, resume="auto")
    batches2 = _batches()
    engine2, state = resumed.start(_model(1), _engine, batches2, max_steps=10)  # other initial weights
    assert state.step == 3 and state.samples == 6
    assert all(
        torch.equal(a, b)
        for a, b in zip(engine.model_state_dict().values(), engine2.model_state_dict().values(), strict=True)
    )
    assert torch.equal(next(batches2)[0], expected_next)
    assert resumed.record["resumed_from"]["optimizer_restored"] is True
    resumed.finish("completed")
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["status"] == "completed" and record["attempts"][0]["error"] == "killed"


def test_a_checkpoint_beyond_max_steps_or_for_another_model_is_refused(tmp_path):
    run = _open(tmp_path)
    run.start(_model(), _engine, _batches(), max_steps=10)
    run.save(LoopState(step=5))
    with pytest.raises(OrtflowError, match=r"trainer\.max_steps=4"):
        _open(tmp_path, resume="auto").start(_model(), _engine, _batches(), max_steps=4)
    wider = torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256))
    with pytest.raises(OrtflowError, match="does not fit this model"):
        _open(tmp_path, resume="auto").start(wider, _engine, _batches(), max_steps=10)


def test_ranks_other_than_0_write_nothing(tmp_path):
    run = _open(tmp_path, world=World(rank=1, local_rank=1, size=2))
    run.start(_model(), _engine, _batches(), max_steps=10)
    assert run.save(LoopState(step=2)).endswith("step-00000002.pt")
    run.write_final({})
    run.finish("completed")
    assert list(tmp_path.iterdir()) == []


def test_a_new_run_in_a_dir_with_an_earlier_attempt_moves_it_aside(tmp_path):
    first = _open(tmp_path)
    first.start(_model(), _engine, _batches(), max_steps=10)  # it trained
    first.finish("failed", error="boom")
    second = _open(tmp_path)
    assert (tmp_path / "previous-attempt-1" / "run.json").is_file()
    assert "attempts" not in second.record


def test_an_earlier_attempt_that_never_trained_stays_in_the_record_only(tmp_path):
    _open(tmp_path).finish("failed", error="config")
    second = _open(tmp_path)
    assert not list(tmp_path.glob("previous-attempt-*"))
    assert second.record["attempts"][0]["error"] == "config"


@pytest.mark.parametrize(
    ("env", "args", "expected"),
    [
        ({}, ["accel=none"], []),
        ({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}, [], ["torchrun-abc"]),
        ({"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}, [], ["output_subdir=null"]),
        ({"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}, ["hydra.run.dir=x"], ["output_subdir=null"]),
    ],
)
def test_rank_overrides(monkeypatch, env, args, expected):
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    extra = rank_overrides(args)
    assert all(any(e in x for x in extra) for e in expected) and (extra == []) == (expected == [])


def test_rank_overrides_refuse_a_sweep_and_an_unnamed_run(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(OrtflowError, match="sweep"):
        rank_overrides(["-m"])
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(OrtflowError, match="--rdzv_id"):
        rank_overrides([])


def test_tied_weights_are_written_once_whatever_engine_copied_them():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.head = torch.nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight  # tied, as a language model's input and output layers
            self.other = torch.nn.Linear(8, 8, bias=False)
            self.same_values = torch.nn.Linear(8, 8, bias=False)  # equal to `other`, but not tied
            self.same_values.weight.data.copy_(self.other.weight.data)

    model = Tied()
    copied = {k: v.clone() for k, v in model.state_dict().items()}  # as an ORT engine returns them
    shared = checkpoint.share_tied(copied, model)
    assert shared["head.weight"] is shared["embed.weight"]
    assert shared["same_values.weight"] is not shared["other.weight"]
    assert all(torch.equal(shared[k], copied[k]) for k in copied)
    restored = Tied()
    restored.load_state_dict(shared)
    assert restored.head.weight is restored.embed.weight and torch.equal(restored.embed.weight, model.embed.weight)
