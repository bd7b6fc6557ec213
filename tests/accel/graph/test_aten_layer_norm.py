"""accel.aten_layer_norm: every LayerNorm an ATen node run by torch's kernels inside ORT's graphs, in both engines.

The forms LayerNorm takes (affine or not, without bias, over more than the last dimension, on a model input that
needs no gradient, frozen) give eager PyTorch's loss and gradients, and ORT's run counters prove ORT ran them."""

import copy
import io

import onnx
import pytest
import torch
from torch import nn

from ortflow.step.batch import Layout
from ortflow.step.loss import CrossEntropy
from ortflow.step.with_loss import WithLoss
from tests.accel.test_vision_engines import RTOL, assert_ort_trained, make_engine, train_both

FEATURES, CLASSES, BATCH, STEPS = 8, 5, 6, 4


class Norms(nn.Module):
    """(batch, 4, 8) features -> LayerNorm over them straight from the input -> Linear -> the LayerNorm form
    under test -> mean over positions -> classes."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.first = nn.LayerNorm(FEATURES)  # on the model's input: no gradient wanted for it
        self.proj = nn.Linear(FEATURES, FEATURES)
        shape = (4, FEATURES) if form == "two_dims" else FEATURES
        self.norm = nn.LayerNorm(shape, elementwise_affine=form != "no_affine", bias=form != "no_bias")
        if form == "frozen":
            self.norm.requires_grad_(False)
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.proj(self.first(x)))).mean(dim=1))


FORMS = ["affine", "no_affine", "no_bias", "two_dims", "frozen"]


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(BATCH, 4, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
        for _ in range(steps)
    ]


def build(form: str) -> nn.Module:
    torch.manual_seed(0)
    model = Norms(form)
    with torch.no_grad():  # weights and biases away from their ones and zeros: a dropped one would show
        for name, p in model.named_parameters():
            if "norm" in name or "first" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("form", FORMS)
def test_artifacts_gives_eagers_loss_and_gradients(form, tmp_path):
    x, y = batches(1)[0]
    model = build(form)
    reference = WithLoss(copy.deepcopy(model), CrossEntropy(), Layout(1, single=True)).train()
    engine = make_engine("artifacts", copy.deepcopy(model), (x, y), tmp_path, aten_layer_norm=True)
    assert engine.describe()["graph_fixes"]["layer_norms_run_by_torch"] == 2
    loss, grads = engine.gradients(x, y)
    expected = reference(x, y)
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-6)
    trainable = {n: p for n, p in reference.model.named_parameters() if p.requires_grad}
    assert set(grads) == set(trainable)
    for name, p in trainable.items():
        torch.testing.assert_close(torch.from_numpy(grads[name]), p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("form", FORMS)
def test_ortmodule_trains_with_eagers_losses(form, tmp_path):
    eager, engine, expected, got = train_both(
        "ortmodule", lambda: build(form), batches(), tmp_path, aten_layer_norm=True
    )
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL["ortmodule"], atol=0)
    assert_ort_trained(engine, STEPS)
    assert engine.describe()["graph_fixes"]["layer_norms_run_by_torch"] == 2
    for name, p in eager.model_state_dict().items():  # every parameter moved as eager moved it, frozen ones not
        torch.testing.assert_close(engine.model_state_dict()[name], p, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_off_leaves_layer_norm_to_ort(kind, tmp_path):
    _, engine, expected, got = train_both(kind, lambda: build("affine"), batches(), tmp_path, aten_layer_norm=False)
    assert "layer_norms_run_by_torch" not in engine.describe()["graph_fixes"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, STEPS)


# The user's own call of the legacy exporter passes through ortflow's export wrapper (compat/torch_patches.py), which
# torch's deprecation notice then names as its caller.
@pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The feature will be removed. Please remove usage:DeprecationWarning")
@pytest.mark.parametrize("opset", [16, 17])
def test_an_export_outside_the_engines_is_torchs_own(opset, tmp_path):
    """After both engines exported (registering ortflow's LayerNorm symbolic at their opsets), a user's own export
    gets standard ONNX: LayerNormalization from opset 17, its decomposition below; never an ATen node."""
    for kind in ("ortmodule", "artifacts"):
        train_both(kind, lambda: build("affine"), batches(1), tmp_path / kind, aten_layer_norm=True)
    model, (x, _) = build("affine").eval(), batches(1)[0]
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, opset_version=opset, dynamo=False)
    ops = {node.op_type for node in onnx.load_from_string(buffer.getvalue()).graph.node}
    assert "ATen" not in ops
    assert ("LayerNormalization" in ops) == (opset >= 17)
