"""Cross-entropy by torch inside ORT's graphs (ortflow/accel/graph/aten_cross_entropy.py): the exported loss found and
replaced, torch's values and gradient, and the LM head's bf16 GEMM and loss fused into one node that gives autocast's
eager loss and gradients. The engines' runs: tests/accel/graph/test_aten_gelu.py (a GPT-2 LoRA in both ORT engines)."""

import io

import onnx
import pytest
import torch
import torch.nn.functional as F

from ortflow.accel.graph import aten_cross_entropy

LEGACY_EXPORT = pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export")
EXPORTER_LOGGING = pytest.mark.filterwarnings("ignore:The feature will be removed. Please remove usage")
MEAN, SUM = aten_cross_entropy.REDUCTIONS["mean"], aten_cross_entropy.REDUCTIONS["sum"]


class Loss(torch.nn.Module):
    def __init__(self, reduction: str = "mean", weighted: bool = False) -> None:
        super().__init__()
        self.reduction, self.weight = reduction, torch.rand(5) if weighted else None

    def forward(self, logits, targets):
        return F.cross_entropy(logits, targets, weight=self.weight, ignore_index=-100, reduction=self.reduction)


def exported(module: torch.nn.Module) -> onnx.ModelProto:
    buffer = io.BytesIO()
    example = (torch.randn(6, 5), torch.randint(0, 5, (6,)))
    torch.onnx.export(module, example, buffer, opset_version=17, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


@LEGACY_EXPORT
@EXPORTER_LOGGING
def test_the_exported_loss_becomes_one_aten_node_and_a_weighted_or_unreduced_one_stays_orts():
    model = exported(Loss())
    assert aten_cross_entropy.softmax_cross_entropies_to_aten(model) == 1
    (node,) = [n for n in model.graph.node if n.op_type != "Constant"]
    assert node.op_type == "ATen" and node.output[0] == model.graph.output[0].name
    onnx.checker.check_model(model)
    for other in (Loss(weighted=True), Loss(reduction="none")):
        model = exported(other)
        assert aten_cross_entropy.softmax_cross_entropies_to_aten(model) == 0
        # ONNX's SoftmaxCrossEntropyLoss, or ORTModule's ...Internal where ORTModule's symbolics are registered
        assert any(n.op_type.startswith("SoftmaxCrossEntropyLoss") for n in model.graph.node)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_loss_and_its_gradient_are_torchs_with_ignored_targets(reduction):
    torch.manual_seed(0)
    logits = torch.randn(12, 7, dtype=torch.float64).float().requires_grad_(True)
    targets = torch.randint(0, 7, (12,))
    targets[[2, 5]] = -100
    expected = F.cross_entropy(logits, targets, ignore_index=-100, reduction=reduction)
    (grad,) = torch.autograd.grad(expected * 0.5, logits)
    code = aten_cross_entropy.REDUCTIONS[reduction]
    mine = torch.ops.ortflow.cross_entropy(logits.detach(), targets, -100, code)
    torch.testing.assert_close(mine, expected.detach())
    mine_grad = torch.ops.ortflow.cross_entropy_backward(torch.tensor(0.5), logits.detach(), targets, -100, code)
    torch.testing.assert_close(mine_grad, grad)
    assert mine_grad[[2, 5]].abs().max() == 0


def eager_bf16(hidden, weight, targets, reduction):
    """The LM head and its loss as eager PyTorch computes them under CPU autocast (bf16 GEMM, fp32 loss)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)
    flat = logits.float().reshape(-1, logits.size(-1))
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize(("reduction", "scale"), [("mean", 1.0), ("sum", 0.25)])
def test_the_fused_lm_head_loss_gives_autocasts_loss_and_gradients(reduction, scale):
    torch.manual_seed(0)
    hidden = torch.randn(3, 40, 16, requires_grad=True)  # 120 rows: several of the fused loss's passes
    weight = (torch.randn(300, 16) * 0.3).requires_grad_(True)
    targets = torch.randint(0, 300, (3, 40))
    targets[0, :7] = -100
    expected = eager_bf16(hidden, weight, targets, reduction)
    grads = torch.autograd.grad(expected * scale, (hidden, weight))
    code = aten_cross_entropy.REDUCTIONS[reduction]
    mask = [True, True, False]
    shape = [-1, 300]
    loss, saved, a16, b16, returned = torch.ops.ortflow.linear_cross_entropy_bf16(
        hidden.detach(), weight.detach(), torch.zeros(0), True, mask, shape, targets, -100, code, False
    )
    assert returned.numel() == 0 and saved.dtype == torch.bfloat16 and saved.shape == (3, 40, 300)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)
    mine = torch.ops.ortflow.linear_cross_entropy_bf16_backward(
        torch.tensor(scale), saved, a16, b16, torch.zeros(0), True, mask
    )
    for got, want in zip(mine[:2], grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4 * scale)
    assert mine[2] is None
    *_, logits = torch.ops.ortflow.linear_cross_entropy_bf16(
        hidden.detach(), weight.detach(), torch.zeros(0), True, mask, shape, targets, -100, code, True
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(logits, F.linear(hidden.detach(), weight.detach()).float())
