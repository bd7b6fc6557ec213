"""The vision side from the command line: the vision recipe (composes in every accel mode, trains above chance),
model=resnet, torchvision models by name or by _target_ (a ResNet-18, a small ViT), and the same models and the recipe
in the ORT modes (ORT's run counters, and eager's accuracy for the recipe)."""

import json
import sys

import pytest
from hydra.utils import instantiate

import ortflow
from ortflow.errors import ModelError
from ortflow.model import builder_node
from ortflow.model.torchvision_models import build_torchvision
from ortflow.validate import validate
from tests.conftest import make_cfg

# A few images, small batches: enough for every part of a run (train, eval, record) in seconds.
SMALL = ["data.train_images=64", "data.val_images=32", "data.batch_size=8", "logger.progress=false"]
VIT_KWARGS = {"image_size": 32, "patch_size": 8, "num_layers": 1, "num_heads": 2, "hidden_dim": 32, "mlp_dim": 64}
VIT = ["model=torchvision", "model.name=VisionTransformer", *(f"+model.kwargs.{k}={v}" for k, v in VIT_KWARGS.items())]


def record(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())


@pytest.mark.parametrize("accel", ["none", "ortmodule", "artifacts"])
def test_the_vision_recipe_composes_in_every_accel_mode(accel):
    cfg = make_cfg("+recipe=vision", f"accel={accel}")
    validate(cfg)
    assert cfg.model._target_.endswith("build_resnet") and cfg.data._target_.endswith("build_images_data")
    assert cfg.model.num_classes == 10 and cfg.model.in_channels == 3


def test_the_resnet_option_builds_the_configured_depth():
    model = instantiate(
        builder_node(make_cfg("model=resnet", "data=images", "model.blocks=[2,1]", "model.width=8").model)
    )
    assert len(model.stages) == 3 and model.head.in_features == 16


MODELS = [
    ["model=resnet"],
    ["model=torchvision", "model.name=resnet18"],
    ["model=custom", "model._target_=torchvision.models.resnet18", "+model.num_classes=10"],
    VIT,
]


@pytest.mark.parametrize("model", MODELS, ids=["resnet", "torchvision-resnet18", "target-resnet18", "torchvision-vit"])
def test_vision_models_train_from_the_command_line(model, tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(
        "data=images", *model, *SMALL, "trainer.fast_dev_run=2", "hydra.run.dir=r", cwd=tmp_path
    )
    assert status == 0, stderr[-3000:]
    run = record(tmp_path / "r")
    assert run["status"] == "completed" and run["metrics"]["steps"] == 2
    assert run["engine"]["executed_by"] == "pytorch"
    depends = run["data"]["short_batches"]["model_depends_on_batch"]
    assert depends["in_training"] == (model != VIT)  # BatchNorm in the ResNets, LayerNorm in the ViT


def test_an_unknown_torchvision_name_suggests_the_close_ones():
    with pytest.raises(ModelError, match=r"model\.name=resnet81 .*did you mean \['resnet18'"):
        build_torchvision("resnet81", 10)


def test_a_builder_that_fixes_its_architecture_points_to_the_class():
    with pytest.raises(ModelError, match=r"refused its arguments.*model\.name=VisionTransformer"):
        build_torchvision("vit_b_16", 10, kwargs={"patch_size": 8})


def test_model_torchvision_without_torchvision_names_the_extra_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision raises ImportError
    with pytest.raises(ModelError, match=r"pip install 'ortflow\[vision\]'"):
        build_torchvision("resnet18", 10)


def test_a_torchvision_model_by_name_takes_its_keyword_arguments():
    model = build_torchvision("VisionTransformer", 7, kwargs=VIT_KWARGS)
    assert model.heads.head.out_features == 7 and model.patch_size == 8


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["ortmodule", "artifacts"])
@pytest.mark.parametrize("model", [MODELS[1], MODELS[3]], ids=["torchvision-resnet18", "torchvision-vit"])
def test_vision_models_train_in_the_ort_modes(model, accel, tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(
        "data=images", *model, *SMALL, f"accel={accel}", "trainer.fast_dev_run=2", "hydra.run.dir=r", cwd=tmp_path
    )
    assert status == 0, stderr[-3000:]
    engine = record(tmp_path / "r")["engine"]
    assert engine["executed_by"] == "onnxruntime" and engine["ort_train_steps"] == 2 and engine["ort_eval_batches"] == 1


# The recipe shortened the same way in every mode (150 of its 600 steps: 0.365 accuracy in eager on a 2-core Zen 5 VM,
# chance is 0.1). One test for the three runs: split, each test worker would run the eager reference again.
RECIPE_SHORT = ["+recipe=vision", "trainer.max_steps=150", "trainer.eval_every=0", "logger.progress=false"]
LEARNED = 0.3  # 3x chance: the shapes are being learned


@pytest.mark.slow
def test_the_vision_recipe_shortened_learns_the_shapes_in_every_mode_to_eager_accuracy(tmp_path):
    eager = ortflow.train([*RECIPE_SHORT, "accel=none"], run_dir=tmp_path / "none")
    assert eager.status == "completed" and eager.record["engine"]["executed_by"] == "pytorch"
    assert eager.metrics["eval/accuracy"] > LEARNED  # 10 balanced classes: chance is 0.1
    for accel in ("ortmodule", "artifacts"):
        ort = ortflow.train([*RECIPE_SHORT, f"accel={accel}"], run_dir=tmp_path / accel)
        engine = ort.record["engine"]
        assert engine["executed_by"] == "onnxruntime" and engine["ort_train_steps"] == 150, accel
        assert engine.get("torch_fallback_train_steps", 0) == 0 and engine["ort_eval_batches"] > 0, accel
        # The same initial weights and batches; float rounding differs over 150 steps: within 3 images in 100.
        assert abs(ort.metrics["eval/accuracy"] - eager.metrics["eval/accuracy"]) <= 0.03, accel
        assert ort.metrics["eval/accuracy"] > LEARNED, accel
