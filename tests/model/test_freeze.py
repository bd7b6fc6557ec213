"""model.freeze: frozen parameters get no gradient, no optimizer state and no update in every engine; frozen
BatchNorm layers keep their running statistics; the run header and run.json count trainable / total parameters;
a checkpoint holds the trained parameters and the frozen base's fingerprint."""

import copy
import json

import onnx
import pytest
import torch
from torch import nn

from ortflow.accel.compat.ortmodule_patches import training_graph
from ortflow.api import train
from ortflow.errors import CheckpointError, ConfigError
from ortflow.model.freeze import FrozenBatchNorm, freeze
from tests.accel.test_vision_engines import RTOL, assert_ort_trained, conv_bn, images, make_engine

FROZEN = ["0", "1", "3"]  # the first convolution, its BatchNorm and the second convolution (its BatchNorm trains)


def frozen_conv_bn() -> nn.Module:
    return freeze(conv_bn(), FROZEN)


def test_patterns_freeze_parameters_and_batchnorms_keep_their_names_and_statistics():
    model = conv_bn()
    reference = copy.deepcopy(model).eval()
    freeze(model, ["0", "1.*"])
    assert isinstance(model[1], FrozenBatchNorm) and isinstance(model[4], nn.BatchNorm2d)  # 4 keeps training
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["0.weight", "1.weight", "1.bias"]
    assert model.state_dict().keys() == reference.state_dict().keys()
    x = torch.randn(4, 3, 16, 16)
    model.train()  # a frozen BatchNorm normalises with its running statistics in training too
    stem, frozen_stem = reference[:2], model[:2]
    torch.testing.assert_close(frozen_stem(x), stem(x))
    assert torch.equal(model[1].running_mean, reference[1].running_mean)


@pytest.mark.parametrize(
    ("patterns", "says"),
    [(["backbone"], "matches no parameter"), (["*"], "freezes every parameter")],
)
def test_patterns_that_match_nothing_or_everything_are_refused(patterns, says):
    with pytest.raises(ConfigError, match=says):
        freeze(conv_bn(), patterns)


@pytest.mark.parametrize("kind", ["none", "ortmodule", "artifacts"])
def test_frozen_parameters_stay_bit_identical_and_get_no_gradient_in_every_engine(kind, tmp_path):
    batches = images()
    model = frozen_conv_bn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eager = make_engine("none", copy.deepcopy(model), batches[0], tmp_path)
    engine = eager if kind == "none" else make_engine(kind, model, batches[0], tmp_path)
    expected = [eager.train_step(x, y) for x, y in batches] if kind != "none" else None
    got = [engine.train_step(x, y) for x, y in batches]
    if expected is not None:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
        assert_ort_trained(engine, len(batches))
    after = engine.model_state_dict()
    frozen = [k for k in before if k.split(".")[0] in FROZEN]
    assert frozen and all(torch.equal(after[k], before[k]) for k in frozen)  # statistics of the frozen BN too
    assert not torch.equal(after["9.running_mean"], before["9.running_mean"])  # a training BatchNorm's do move
    assert not torch.equal(after["11.weight"], before["11.weight"])
    if kind == "artifacts":  # ORT's training graph has gradients for the trainable parameters only
        outputs = {o.name for o in onnx.load(str(tmp_path / "artifacts" / "training_model.onnx")).graph.output}
        grads = {o.removeprefix("model.").removesuffix("_grad.accumulation.out") for o in outputs if "_grad" in o}
        assert grads == {n for n, p in model.named_parameters() if p.requires_grad}
    else:  # no gradient and no optimizer state for them
        optimizer = (engine if kind == "none" else engine.inner).optimizer
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, param in (eager.model if kind == "none" else model).named_parameters():
            assert (id(param) in params) == param.requires_grad, name
            assert (param.grad is None) or param.requires_grad, name


def _ort_gradients(engine) -> set[str]:
    """The parameters ORTModule's training graph computes a gradient for (its gradient outputs)."""
    outputs = [o.name for o in training_graph(engine.module).graph.output if o.name.endswith("_grad")]
    return {o.removeprefix("_original_module.model.").removesuffix("_grad") for o in outputs}


def test_ortmodule_builds_no_gradient_for_frozen_weights_and_rebuilds_when_one_is_unfrozen(tmp_path):
    torch.manual_seed(0)
    # Frozen: the first Linear and one between two that train (its input gradient still flows, its weight's not).
    layers = [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()]
    model = freeze(nn.Sequential(*layers, nn.Linear(32, 5)), ["0", "4"])
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eager = make_engine("none", copy.deepcopy(model), batches[0], tmp_path)
    engine = make_engine("ortmodule", model, batches[0], tmp_path)
    expected = [eager.train_step(x, y) for x, y in batches]
    got = [engine.train_step(x, y) for x, y in batches]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL["ortmodule"], atol=0)
    assert_ort_trained(engine, len(batches))
    assert _ort_gradients(engine) == {"2.weight", "2.bias", "6.weight", "6.bias"}
    # 4 forward GEMMs; backward: a weight gradient for 2 and 6, an input gradient through 6 and the frozen 4 only.
    assert sum(n.op_type in ("Gemm", "MatMul") for n in training_graph(engine.module).graph.node) == 4 + 4
    after = engine.model_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in ("0.weight", "0.bias", "4.weight", "4.bias"))
    assert not torch.equal(after["2.weight"], before["2.weight"])
    model[4].requires_grad_(True)  # the next training step exports and builds the graphs again
    engine.train_step(*batches[0])
    assert _ort_gradients(engine) == {"2.weight", "2.bias", "4.weight", "4.bias", "6.weight", "6.bias"}
    assert model[4].weight.grad is not None and model[4].weight.grad.abs().sum() > 0
    assert_ort_trained(engine, len(batches) + 1)


def test_a_run_counts_trainable_parameters_and_its_checkpoints_refuse_another_base(tmp_path):
    common = ["model=mlp", "data=digits", "data.seed=0", "trainer.max_steps=4", "logger.tensorboard=false"]
    result = train([*common, "model.freeze=['1']"], run_dir=tmp_path / "run")
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["parameters"] == {"total": 17226, "trainable": 17226 - 8192 - 128, "frozen": 8192 + 128}
    assert "trainable" in (tmp_path / "run" / "ortflow.log").read_text()
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-00000004.pt", weights_only=True)
    assert set(saved["model"]) == {"3.weight", "3.bias", "5.weight", "5.bias"} and saved["frozen_base"]
    assert not result.model[1].weight.requires_grad
    resumed = [*common, "trainer.max_steps=5", "trainer.resume=auto"]
    with pytest.raises(CheckpointError, match="frozen base"):  # another base (other initial weights) is refused
        train([*resumed, "model.freeze=['1']", "seed=1"], run_dir=tmp_path / "run")
    train([*resumed, "model.freeze=['1']"], run_dir=tmp_path / "run")  # the same base continues


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_a_frozen_torchvision_backbone_trains_only_its_head_in_ort(kind, tmp_path):
    from ortflow.model.torchvision_models import build_torchvision

    torch.manual_seed(0)
    model = freeze(build_torchvision("resnet18", num_classes=5), ["conv1", "bn1", "layer*"])
    assert sum(isinstance(m, FrozenBatchNorm) for m in model.modules()) == 20
    batches = images(2, shape=(3, 32, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = make_engine(kind, model, batches[0], tmp_path)
    for x, y in batches:
        engine.train_step(x, y)
    assert_ort_trained(engine, len(batches))
    after = engine.model_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("fc."))
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
