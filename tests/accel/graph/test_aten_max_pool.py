"""2-D max-pooling run by torch's kernels in ORT's graphs (accel/graph/aten_max_pool.py): the artifacts engine's
gradients are eager's with it, bit for bit, and ORT's MaxPool stays where `accel.aten_max_pool=false` says so; ceil
mode and padding reach torch's kernel (a shape they change)."""

import copy

import pytest
import torch
from torch import nn

from ortflow.step.batch import Layout
from ortflow.step.loss import CrossEntropy
from ortflow.step.with_loss import WithLoss
from tests.accel.test_vision_engines import CLASSES, images, make_engine


def pooled() -> nn.Module:
    """Two max-pools: 3x3 stride 2 padding 1 (ResNet's stem) and 2x2 in ceil mode on an odd size."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),  # 16 -> 8
        nn.Conv2d(8, 8, 2),  # 8 -> 7
        nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),  # 7 -> 4
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, CLASSES),
    )


@pytest.mark.parametrize("aten_max_pool", ["null", "false"])
def test_max_pools_run_by_torch_give_eagers_gradients(aten_max_pool, tmp_path):
    x, y = images(1)[0]
    model = pooled()
    reference = WithLoss(copy.deepcopy(model), CrossEntropy(), Layout(1, single=True)).train()
    engine = make_engine("artifacts", model, (x, y), tmp_path, aten_max_pool=aten_max_pool)
    by_torch = engine.describe()["graph_fixes"].get("max_pools_run_by_torch", 0)
    assert by_torch == (2 if aten_max_pool == "null" else 0)
    loss, grads = engine.gradients(x, y)
    expected = reference(x, y)
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-6)
    for name, p in reference.model.named_parameters():
        got = torch.from_numpy(grads[name])
        if by_torch:  # torch's kernels on the same values: eager's gradients
            torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-7, msg=name)
        else:
            torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6, msg=name)
