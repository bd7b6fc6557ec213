"""An ORT failure in either engine is one paragraph naming the ONNX op (or torch operator), the module of the
user's model that produced it, ORT's reason and what works instead; injected at export, graph build and step time.
Through the command line: exit status 2, no traceback, run.json `failed` with the reason."""

import importlib
import json

import pytest
import torch
from torch import nn

from ortflow.errors import OrtflowError
from tests.accel.test_vision_engines import images, make_engine
from tests.conftest import TINY, USER_ENV, custom_model

KINDS = ["ortmodule", "artifacts"]


class Body(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.shuffle = nn.ChannelShuffle(2)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.op == "channel_shuffle":
            return self.shuffle(x)
        return x * x.prod(dim=1, keepdim=True) if self.op == "prod" else torch.relu(x)


class Net(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.body = Body(op)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def failure(kind: str, op: str, tmp_path, steps: int = 1) -> str:
    batches = images(steps)
    with pytest.raises(OrtflowError) as raised:
        engine = make_engine(kind, Net(op), batches[0], tmp_path)
        for x, y in batches:
            engine.train_step(x, y)
    message = str(raised.value)
    assert "Traceback" not in message and "\n" not in message and "/onnxruntime_src/" not in message
    assert f"accel={kind}" in message and "accel=none" in message
    return message


@pytest.mark.parametrize("kind", KINDS)
def test_an_op_the_exporter_cannot_export_is_named_with_its_module(kind, tmp_path):
    message = failure(kind, "channel_shuffle", tmp_path)
    assert "could not export" in message
    assert "aten::channel_shuffle" in message and "body.shuffle (ChannelShuffle)" in message


@pytest.mark.parametrize("kind", KINDS)
def test_an_op_without_an_ort_gradient_is_named_with_its_module(kind, tmp_path):
    message = failure(kind, "prod", tmp_path)
    assert "the ONNX op ReduceProd of module body (Body)" in message
    assert "has no gradient" in message and "docs/ort-gradients.md" in message


@pytest.mark.parametrize("kind", KINDS)
def test_a_kernel_raising_at_step_time_is_named_with_its_module(kind, tmp_path, monkeypatch):
    """torch's convolution backward, run inside ORT's graph by an ATen node, raises from the second step on."""
    calls = {"n": 0}
    backward = torch.ops.aten.convolution_backward

    def raising(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("injected kernel failure")
        return backward(*args, **kwargs)

    # torch.optim imports torch._dynamo on first use, which reads convolution_backward's overloads: imported first.
    importlib.import_module("torch._dynamo")
    monkeypatch.setattr(torch.ops.aten, "convolution_backward", raising)
    message = failure(kind, "relu", tmp_path, steps=2)
    assert "run a train" in message or (
        "run a training step" in message and "the ONNX op ATen of module body.conv (Conv2d)" in message
    )
    assert "injected kernel failure" in message


def test_the_command_line_exits_2_with_the_paragraph_and_records_it(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(USER_ENV["PYTHONPATH"].split(":")[0])
    args = [*custom_model("build_product"), *TINY[4:], "accel=artifacts", "hydra.run.dir=r"]
    status, stderr = ortflow_cli(*args, cwd=tmp_path)
    assert status == 2 and "Traceback" not in stderr
    assert "the ONNX op ReduceProd of module 1 (Product)" in stderr
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["status"] == "failed" and "ReduceProd" in run["error"]
