"""An ORT failure in either engine is one paragraph naming the ONNX op (or torch operator), the module of the
user's model that produced it, ORT's reason and what works instead; injected at export, graph build and step time.
Through the command line: exit status 2, no traceback, run.json `failed` with the reason."""

import importlib
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ortflow.accel import failures
from ortflow.accel.graph import aten_conv, aten_nodes, pipeline
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
def test_a_kernel_raising_in_ortflows_node_at_step_time_is_possibly_ortflows(kind, tmp_path, monkeypatch):
    """torch's convolution backward, run inside ORT's graph by ortflow's ATen node, raises from the second step on:
    the node is ortflow's (with accel.aten_conv=false ORT's own Conv would run), so the failure is not called the
    model's limit; it keeps its traceback (GraphWorkError), naming the node and ORT's reason."""
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
    message = ortflows(kind, tmp_path, steps=2)
    assert "conv" in message and "injected kernel failure" in message


def ortflows(kind: str, tmp_path, steps: int = 1) -> str:
    """The GraphWorkError an engine raises on Net("relu") (the message, checked to say it is possibly ortflow's)."""
    batches = images(steps)
    with pytest.raises(failures.GraphWorkError) as raised:
        engine = make_engine(kind, Net("relu"), batches[0], tmp_path)
        for x, y in batches:
            engine.train_step(x, y)
    message = str(raised.value)
    assert f"accel={kind} could not" in message and "which ortflow's graph work wrote" in message, message
    assert "possibly a bug in ortflow" in message
    return message


def _head_input(model: onnx.ModelProto) -> onnx.NodeProto:
    """The node of the head (nn.Linear: Gemm, or MatMul) that reads the pooled features."""
    return next(n for n in model.graph.node if "/head/" in n.name and n.op_type in ("Gemm", "MatMul"))


def invalid_reshape(model: onnx.ModelProto, plan, work) -> None:
    """A rewrite that builds an invalid graph: the head's input reshaped to a size it does not have."""
    head = _head_input(model)
    shape = helper.make_node("Constant", [], ["planted/shape"], value=numpy_helper.from_array(np.array([7, 3])))
    reshape = helper.make_node(
        "Reshape", [head.input[0], "planted/shape"], ["planted/reshaped"], name="planted/Reshape"
    )
    head.input[0] = "planted/reshaped"
    _before(model, head, [shape, reshape])


def wrong_dtype(model: onnx.ModelProto, plan, work) -> None:
    """A rewrite that hands ORT a value of the wrong dtype: the head's input cast to float64."""
    head = _head_input(model)
    cast = helper.make_node("Cast", [head.input[0]], ["planted/cast"], name="planted/Cast", to=TensorProto.DOUBLE)
    head.input[0] = "planted/cast"
    _before(model, head, [cast])


def wrong_shape_into_torch(model: onnx.ModelProto, plan, work) -> None:
    """ortflow's convolution node given its weight transposed (a wrong shape into torch's kernel)."""
    conv = next(n for n in model.graph.node if aten_nodes.operator(n) == aten_conv.OPERATOR)
    flip = helper.make_node(
        "Transpose", [conv.input[1]], ["planted/weight"], name="planted/Transpose", perm=[1, 0, 2, 3]
    )
    conv.input[1] = "planted/weight"
    _before(model, conv, [flip])


def without_gradient(model: onnx.ModelProto, plan, work) -> None:
    """A rewrite that writes an op ORT has no gradient builder for (Hardmax) on the trainable path: ORT's message is
    the one it gives for a model's op it cannot train, but the node is ortflow's."""
    head = _head_input(model)
    hardmax = helper.make_node("Hardmax", [head.input[0]], ["planted/hardmax"], name="planted/Hardmax")
    add = helper.make_node("Add", [head.input[0], "planted/hardmax"], ["planted/sum"], name="planted/Add")
    head.input[0] = "planted/sum"
    _before(model, head, [hardmax, add])


def _before(model: onnx.ModelProto, node: onnx.NodeProto, added: list[onnx.NodeProto]) -> None:
    nodes = list(model.graph.node)
    at = next(i for i, n in enumerate(nodes) if n is node or n == node)
    del model.graph.node[:]
    model.graph.node.extend([*nodes[:at], *added, *nodes[at:]])


@pytest.mark.parametrize("plant", [invalid_reshape, wrong_dtype, wrong_shape_into_torch, without_gradient])
@pytest.mark.parametrize("kind", KINDS)
def test_a_rewrite_that_breaks_the_graph_is_reported_as_possibly_ortflows(kind, plant, tmp_path):
    """Realistic bugs of ortflow's graph work, planted as its last step: ORT's error names a node (or value) ortflow
    wrote, so the failure is not blamed on the model (no paragraph telling the user to switch engines)."""
    with pipeline.planted(plant):
        message = ortflows(kind, tmp_path)
    assert "graph node " in message or "value planted/" in message, message


def test_the_command_line_exits_2_with_the_paragraph_and_records_it(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(USER_ENV["PYTHONPATH"].split(":")[0])
    args = [*custom_model("build_product"), *TINY[4:], "accel=artifacts", "hydra.run.dir=r"]
    status, stderr = ortflow_cli(*args, cwd=tmp_path)
    assert status == 2 and "Traceback" not in stderr
    assert "the ONNX op ReduceProd of module 1 (Product)" in stderr
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["status"] == "failed" and "ReduceProd" in run["error"]
