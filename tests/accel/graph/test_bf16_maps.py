"""bf16 feature maps from torch convolution to torch convolution (accel/graph/bf16_maps.py): each operator computes
what eager autocast computes, bit for bit, forward and backward; in both ORT engines a CNN's convolutions take bf16
exactly where autocast hands them bf16, BatchNorm's running statistics and evaluation stay eager's, and a map read
four times (two convolutions, a max-pool and an op ORT has no bf16 kernel for) trains as eager does."""

import copy

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from ortflow import accel
from ortflow.accel.engine import EngineContext
from ortflow.accel.graph import aten_conv, aten_nodes, bf16_map_ops, bf16_maps
from ortflow.check import capture
from ortflow.config import BF16, DebugConfig, OptimConfig
from ortflow.model.resnet import build_resnet
from tests.accel.test_vision_engines import CLASSES, assert_ort_trained, buffers, images
from tests.conftest import make_cfg

OPS = torch.ops.ortflow
CONV = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)  # stride, padding, dilation, transposed, output_padding, groups


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(True)


def test_each_operator_computes_what_autocast_computes():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, 8, generator=gen)
    w = torch.randn(6, 3, 3, 3, generator=gen) / 4
    gamma, beta = torch.rand(6, generator=gen) + 0.5, torch.randn(6, generator=gen)
    grad = torch.randn(4, 6, 8, 8, generator=gen).bfloat16()

    # the convolution: bf16 product of an fp32 input; its gradients
    ex, ew = _leaf(x), _leaf(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.conv2d(ex, ew, padding=1)
    want.backward(grad)
    out, x16, w16 = OPS.convolution_bf16_maps(x, w, None, *CONV, [True, True, False])
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.detach())
    gx, gw, gb = OPS.convolution_bf16_maps_backward(grad, x16, w16, None, *CONV, [True, True, False, False])
    assert gx.dtype == torch.float32 and torch.equal(gx, ex.grad) and torch.equal(gw, ew.grad) and gb is None
    # a bf16 input: its gradient in bf16
    gx16, _, _ = OPS.convolution_bf16_maps_backward(grad, x16, w16, None, *CONV, [True, True, False, True])
    assert gx16.dtype == torch.bfloat16 and torch.equal(gx16.float(), gx)

    # BatchNorm in training: eager's output and gradients; the batch mean and biased variance written in place
    m16, eg, eb = _leaf(out.detach()), _leaf(gamma), _leaf(beta)
    mean0, var0 = torch.randn(6, generator=gen), torch.rand(6, generator=gen) + 1
    running = (mean0.clone(), var0.clone())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.batch_norm(m16, *running, eg, eb, training=True, momentum=0.1, eps=1e-5)
    want.backward(grad)
    stats = (mean0.clone(), torch.full((6,), -1.0))
    y, mean, invstd = OPS.batch_norm_bf16(m16.detach(), gamma, beta, *stats, 1e-5, [True, True, True])
    assert y.dtype == torch.bfloat16 and torch.equal(y, want.detach())
    n = 4 * 8 * 8
    torch.testing.assert_close(stats[0], (running[0] - 0.9 * mean0) / 0.1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[1] * n / (n - 1), (running[1] - 0.9 * var0) / 0.1, rtol=1e-5, atol=1e-6)
    grads = OPS.batch_norm_bf16_backward(grad, m16.detach(), gamma, mean, invstd, 1e-5, [True, True, True])
    for got, expected in zip(grads, (m16.grad, eg.grad, eb.grad), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    # in evaluation: the running statistics, left as they are
    before = [t.clone() for t in running]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.batch_norm(out, *running, gamma, beta, training=False, eps=1e-5)
    y, _, _ = OPS.batch_norm_bf16_eval(out, gamma, beta, *running, 1e-5, [True, True, True])
    assert torch.equal(y, want) and all(torch.equal(a, b) for a, b in zip(running, before, strict=True))

    # a residual add taking in the ReLU after it, the fork of a map read twice, the pooling: autograd's gradients
    a, b = _leaf(out.detach()), _leaf(y.detach())
    want = torch.relu(a + b)
    want.backward(grad)
    got, shape_a, shape_b = OPS.add_bf16(a.detach(), b.detach(), True, [True, True])
    assert torch.equal(got, want.detach())
    ga, gb = OPS.add_bf16_backward(grad, got, shape_a, shape_b, True, [True, True])
    assert torch.equal(ga, a.grad) and torch.equal(gb, b.grad)
    # broadcast (a per-channel map): its gradient summed as autograd sums it
    c, d = _leaf(out.detach()), _leaf(y[:1, :, :1, :1].detach())
    (c + d).backward(grad)
    got, shape_c, shape_d = OPS.add_bf16(c.detach(), d.detach(), False, [True, True])
    assert torch.equal(got, (c + d).detach())
    gc, gd = OPS.add_bf16_backward(grad, got, shape_c, shape_d, False, [True, True])
    assert torch.equal(gc, c.grad) and gd.shape == d.shape and torch.equal(gd, d.grad)
    shared = _leaf(out.detach())
    (shared * 1).backward(grad)
    (shared + 0).backward(ga)  # autograd adds the two readers' gradients in bf16
    assert torch.equal(OPS.fork_bf16_backward(grad, ga), shared.grad)
    pooled_in = _leaf(out.detach())
    want = F.adaptive_avg_pool2d(pooled_in, 1)
    want.backward(grad[:, :, :1, :1])
    assert torch.equal(OPS.global_average_pool_bf16(out), want.detach())
    assert torch.equal(OPS.global_average_pool_bf16_backward(grad[:, :, :1, :1], out), pooled_in.grad)


class Residual(nn.Module):
    """A stem, a residual block whose input is read by its first convolution and the shortcut, then a map read four
    times: two convolutions and a max-pool (added in bf16), and a sigmoid, which ORT runs in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.left, self.right = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)
        x = self.left(x) + self.right(x) + F.max_pool2d(x, 3, stride=1, padding=1) + torch.sigmoid(x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _residual() -> nn.Module:
    torch.manual_seed(0)
    return Residual()


def _convolution_inputs(model: nn.Module, x: torch.Tensor) -> list[torch.dtype]:
    """The dtype of each convolution's input in one eager forward under CPU autocast, in call order."""
    found: list[torch.dtype] = []
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.register_forward_pre_hook(lambda m, args: found.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.train()(x)
    return found


def _graph_convolution_inputs(model: onnx.ModelProto) -> list[int]:
    """The element type of each forward convolution node's input in a training graph, in graph order."""
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info)}
    operators = (bf16_map_ops.CONVOLUTION, aten_conv.OPERATOR_BF16)
    return [types.get(n.input[0], onnx.TensorProto.FLOAT) for n in graph.node if aten_nodes.operator(n) in operators]


def _engine(kind: str, model: nn.Module, example, tmp, precision: str = BF16):
    """An engine as the runner builds it, in `precision`; ORTModule saves its graphs into tmp/<kind>."""
    debug = OmegaConf.structured(DebugConfig)
    debug.save_onnx = kind == "ortmodule"
    optim = OmegaConf.structured(OptimConfig)
    ctx = EngineContext(model, example, optim, debug=debug, onnx_dir=tmp / kind, precision=precision)
    return accel.build(make_cfg(f"accel={kind}").accel, ctx)


@pytest.mark.parametrize("kind", ["artifacts", "ortmodule"])
def test_a_cnn_hands_bf16_maps_along_where_autocast_does_and_trains_as_eager(kind, tmp_path):
    batches = images()
    torch.manual_seed(0)
    model = _residual()
    eager = _engine("none", copy.deepcopy(model), batches[0], tmp_path)
    engine = _engine(kind, model, batches[0], tmp_path)
    first, want = capture.step_one(eager, lambda: eager.train_step(*batches[0]))
    got_first, have = capture.step_one(engine, lambda: engine.train_step(*batches[0]))
    expected = [first] + [eager.train_step(x, y) for x, y in batches[1:]]
    got = [got_first] + [engine.train_step(x, y) for x, y in batches[1:]]
    # Step-1 gradients: eager's to bf16's rounding (the sigmoid's add runs in fp32 in ORT, a rounding apart); the
    # stem's too, which gets the block input's two gradients through the fork.
    assert want.gradients.keys() == have.gradients.keys()
    for name, value in want.gradients.items():
        error = np.linalg.norm(have.gradients[name] - value) / np.linalg.norm(value)
        assert error < 2e-2, (name, error)
    assert_ort_trained(engine, len(batches))
    fixes = engine.describe()["graph_fixes"]
    # 5 convolutions, 3 BatchNorms, 3 adds (the block's, its ReLU taken in; left + right + max-pool), 4 forks (the
    # block's input, read twice; its output, read four times), the max-pool (ORTModule's own ATen node: not counted)
    assert fixes["convolutions_run_by_torch_bf16"] == 5 and fixes["batchnorms_run_by_torch_bf16"] == 3, fixes
    assert fixes["adds_run_by_torch_bf16"] == 3 and fixes["bf16_maps_read_twice"] == 4, fixes
    assert fixes.get("max_pools_run_by_torch", 0) == (1 if kind == "artifacts" else 0), fixes
    # the first step: eager's loss to bf16's rounding; then within the envelope of a few bf16 steps
    assert got[0] == pytest.approx(expected[0], rel=2e-3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=2e-2, atol=0)
    for name, value in buffers(eager.model_state_dict()).items():  # from bf16 maps as eager's, to bf16's rounding
        torch.testing.assert_close(engine.model_state_dict()[name].float(), value.float(), rtol=1e-3, atol=1e-3)
    x, y = images(1, seed=1)[0]
    assert engine.eval_step(x, y).loss_sum == pytest.approx(eager.eval_step(x, y).loss_sum, rel=2e-2)
    # bf16 at every convolution whose input autocast hands it in bf16, fp32 where it hands fp32 (the image)
    autocast = _convolution_inputs(_residual(), batches[0][0])
    assert autocast == [torch.float32] + [torch.bfloat16] * 4  # the image, then maps
    graph = tmp_path / kind / ("training_model.onnx" if kind == "artifacts" else "model_post_processed_training.onnx")
    elem = {torch.float32: onnx.TensorProto.FLOAT, torch.bfloat16: onnx.TensorProto.BFLOAT16}
    assert _graph_convolution_inputs(onnx.load(str(graph))) == [elem[t] for t in autocast]


def test_fp32_graphs_keep_fp32_maps(tmp_path):
    batches = images(1)
    engine = _engine("artifacts", _residual(), batches[0], tmp_path, "fp32")
    fixes = engine.describe()["graph_fixes"]
    assert not any("bf16" in name for name in fixes), fixes
    assert bf16_maps.feature_maps(onnx.load(str(tmp_path / "artifacts" / "forward.onnx")), True) == 0


@pytest.mark.parametrize("kind", ["artifacts", "ortmodule"])
def test_the_vision_recipes_resnet_keeps_every_map_after_the_image_bf16(kind, tmp_path):
    """The recipe's own model (model=resnet, narrower): every convolution takes bf16 exactly where autocast hands it
    bf16, and the only map given back in fp32 is the pooled one the head reads (autocast's linear would take it in
    bf16: no edge is bf16 where autocast has fp32)."""
    batches = images(1)
    torch.manual_seed(0)
    model = build_resnet(num_classes=CLASSES, width=8)
    autocast = _convolution_inputs(copy.deepcopy(model), batches[0][0])
    assert autocast == [torch.float32] + [torch.bfloat16] * 8
    engine = _engine(kind, model, batches[0], tmp_path)
    engine.train_step(*batches[0])
    assert_ort_trained(engine, 1)
    fixes = engine.describe()["graph_fixes"]
    assert fixes["bf16_maps_to_fp32"] == 1 and fixes["bf16_maps_read_twice"] == 3, fixes
    graph = tmp_path / kind / ("training_model.onnx" if kind == "artifacts" else "model_post_processed_training.onnx")
    elem = {torch.float32: onnx.TensorProto.FLOAT, torch.bfloat16: onnx.TensorProto.BFLOAT16}
    assert _graph_convolution_inputs(onnx.load(str(graph))) == [elem[t] for t in autocast]
