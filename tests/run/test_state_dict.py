"""State dicts kept whole (ortflow/model/state_dict.py): the weights every engine returns carry the model's state_dict
metadata (each module's version), so a module whose `_load_from_state_dict` needs its version completes a run in every
engine, resumes from a checkpoint and exports; a model that refuses its own weights after training loses neither
them nor the run's record."""

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ortflow.accel import build as accel_build
from ortflow.accel.engine import EngineContext
from ortflow.config import DebugConfig, OptimConfig
from ortflow.errors import ModelError
from ortflow.model import state_dict
from ortflow.run import checkpoint
from ortflow.run.reload import rebuild
from ortflow.run.runner import train
from tests.conftest import REPO, make_cfg
from tests.helpers.user_model import build_versioned

VERSIONED = [
    "data=digits",
    "data.batch_size=32",
    "model=custom",
    "model._target_=tests.helpers.user_model.build_versioned",
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "trainer.eval_batches=2",
    "trainer.checkpoint.every=2",
    "logger.progress=false",
]


@pytest.fixture(autouse=True)
def user_models(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def versions(weights) -> dict[str, int]:
    return {name: entry["version"] for name, entry in state_dict.metadata(weights).items()}


def test_copies_and_subsets_keep_the_versions_and_the_digest_covers_them():
    model = build_versioned()
    copied = state_dict.copied(model)
    assert versions(copied) == {"": 1, "0": 3, "1": 1, "2": 3}
    assert all(copied[k] is not v and torch.equal(copied[k], v) for k, v in model.state_dict().items())
    assert versions(state_dict.without(copied, {"0.bias"})) == versions(copied)
    assert "0.bias" not in state_dict.without(copied, {"0.bias"})
    plain = dict(copied)  # a dict comprehension's or a third-party engine's weights: the model's versions added
    assert state_dict.metadata(plain) is None and versions(state_dict.with_metadata(plain, model)) == versions(copied)
    model.load_state_dict(state_dict.with_metadata(plain, model))
    with pytest.raises(ValueError, match="needs its state_dict version 3, got None"):
        model.load_state_dict(plain)
    # A payload written before the versions were kept has the digest it had; a changed version changes it.
    assert checkpoint.digest({"model": plain}) == checkpoint.digest({"model": OrderedDict(plain)})
    changed = state_dict.copied(model)
    changed._metadata["0"] = {"version": 2}
    assert len({checkpoint.digest(x) for x in ({"model": plain}, {"model": copied}, {"model": changed})}) == 3


@pytest.mark.parametrize("accel", ["none", "ortmodule", "artifacts"])
def test_every_engines_weights_carry_the_models_versions(accel, tmp_path):
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g))
    optim = OmegaConf.structured(OptimConfig)
    ctx = EngineContext(build_versioned(), batch, optim, debug=OmegaConf.structured(DebugConfig), onnx_dir=tmp_path)
    engine = accel_build(make_cfg(f"accel={accel}").accel, ctx)
    engine.train_step(*batch)
    weights = engine.model_state_dict()
    assert versions(weights) == versions(build_versioned().state_dict())
    build_versioned().load_state_dict(weights)


@pytest.mark.parametrize("accel", ["none", pytest.param("ortmodule", marks=pytest.mark.slow), "artifacts"])
def test_a_versioned_model_completes_resumes_and_exports_in_every_engine(accel, tmp_path):
    run_dir = tmp_path / "run"
    train(make_cfg(*VERSIONED, f"accel={accel}"), run_dir)
    assert record(run_dir)["status"] == "completed"
    expected = versions(build_versioned().state_dict())
    for name in ("final.pt", "best.pt", "step-00000004.pt"):
        saved = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert versions(saved.get("model", saved)) == expected, name
        checkpoint.load(run_dir / "checkpoints" / name) if name.startswith("step") else None
    fresh = build_versioned()
    fresh.load_state_dict(torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True))  # no ortflow needed
    # Resumed from step 4 to 6, then exported: the checkpoint's weights load into the model before the engine.
    train(
        make_cfg(*VERSIONED, f"accel={accel}", "trainer.max_steps=6", "trainer.resume=auto", "export.onnx=true"),
        run_dir,
    )
    resumed = record(run_dir)
    assert resumed["status"] == "completed" and resumed["resumed_from"]["step"] == 4
    assert resumed["export"]["max_abs_diff"] <= resumed["export"]["tolerance"]
    assert resumed["engine"]["executed_by"] == ("pytorch" if accel == "none" else "onnxruntime")
    _, _, model, _ = rebuild(run_dir, "final")  # ortflow-predict's load
    assert torch.equal(model[0].weight, torch.load(run_dir / "checkpoints" / "final.pt")["0.weight"])


def test_weights_written_without_versions_still_load_in_the_models_own(tmp_path):
    """final.pt and checkpoints written before ortflow kept the metadata: loaded as the model's current versions."""
    run_dir = tmp_path / "run"
    train(make_cfg(*VERSIONED, "trainer.max_steps=2"), run_dir)
    final = run_dir / "checkpoints" / "final.pt"
    torch.save(dict(torch.load(final, weights_only=True)), final)
    step = run_dir / "checkpoints" / "step-00000002.pt"
    payload = checkpoint.load(step)
    checkpoint.write_atomic(checkpoint.seal({**payload, "model": dict(payload["model"])}), step)
    assert state_dict.metadata(torch.load(final, weights_only=True)) is None
    rebuild(run_dir, "final")
    train(make_cfg(*VERSIONED, "trainer.max_steps=3", "trainer.resume=auto"), run_dir)
    assert record(run_dir)["resumed_from"]["step"] == 2


def test_a_model_refusing_its_trained_weights_keeps_them_and_the_record(tmp_path):
    run_dir = tmp_path / "run"
    cfg = make_cfg(*VERSIONED, "model._target_=tests.helpers.user_model.build_refuses_its_weights")
    with pytest.raises(ModelError, match=r"refused its own trained weights.*cannot load a state_dict") as refused:
        train(cfg, run_dir)
    final = run_dir / "checkpoints" / "final.pt"
    assert str(final) in str(refused.value)
    weights = torch.load(final, weights_only=True)
    trained = nn.Linear(32, 10)
    trained.load_state_dict({k.removeprefix("2."): v for k, v in weights.items() if k.startswith("2.")})
    assert not torch.equal(
        trained.weight, torch.load(run_dir / "checkpoints" / "step-00000002.pt")["model"]["2.weight"]
    )
    written = record(run_dir)
    assert written["status"] == "failed" and "refused its own trained weights" in written["error"]
    assert written["metrics"]["train/loss"] > 0 and written["engine"]["executed_by"] == "pytorch"


@pytest.mark.slow
def test_torchvisions_mnasnet_completes_resumes_and_exports(tmp_path):
    """torchvision's MNASNet refuses a state_dict without its version: the final load raised in every engine before
    they kept the metadata. In accel=artifacts (whose weights come back from ORT's state; the other engines' paths are
    the versioned model's above, and MNASNet took 35-64 s per engine on a loaded 2-core machine)."""
    pytest.importorskip("torchvision")
    images = ["data=images", "data.image_size=32", "data.train_images=32", "data.val_images=16", "data.batch_size=8"]
    common = [
        *images,
        "model=torchvision",
        "model.name=mnasnet0_5",
        "model.num_classes=10",
        "accel=artifacts",
        "trainer.eval_every=1",
        "trainer.eval_batches=1",
        "trainer.checkpoint.every=1",
        "logger.progress=false",
    ]
    run_dir = tmp_path / "run"
    train(make_cfg(*common, "trainer.max_steps=1"), run_dir)
    train(make_cfg(*common, "trainer.max_steps=2", "trainer.resume=auto", "export.onnx=true"), run_dir)
    written = record(run_dir)
    assert written["status"] == "completed" and written["resumed_from"]["step"] == 1
    assert written["export"]["max_abs_diff"] <= written["export"]["tolerance"]
    rebuild(run_dir, "final")
