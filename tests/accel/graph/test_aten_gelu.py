"""GELU's tanh approximation by torch inside ORT's bf16 graphs (ortflow/accel/graph/aten_gelu.py): the exported
formula found and replaced, torch's values and gradient, and a GPT-2 (gelu_new) fine-tuned with LoRA in bf16 within
eager bf16's own distance from fp32 in both ORT engines (its loss by torch too, fused with the LM head:
accel/graph/aten_cross_entropy.py), with neither by torch in fp32 unless asked for."""

import io
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from ortflow.accel.graph import aten_gelu
from ortflow.api import train
from tests.model.test_finetune import SIZES, TEXT, VOCAB


class Formula(torch.nn.Module):
    """GPT-2's gelu_new, as transformers writes it; `leak` also returns an intermediate value."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.leak = leak

    def forward(self, x: torch.Tensor):
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        out = 0.5 * x * (1.0 + torch.tanh(inner))
        return (out, inner) if self.leak else out


# torch's notices about its TorchScript-based exporter, which the engines use too
LEGACY_EXPORT = pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export")
EXPORTER_LOGGING = pytest.mark.filterwarnings("ignore:The feature will be removed. Please remove usage")


def exported(module: torch.nn.Module) -> onnx.ModelProto:
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.randn(2, 3, 8),), buffer, opset_version=17, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


@LEGACY_EXPORT
@EXPORTER_LOGGING
def test_the_exported_formula_becomes_one_aten_node_with_torchs_values_and_gradient():
    model = exported(Formula())
    assert aten_gelu.tanh_gelus_to_aten(model) == 1
    ops = [n.op_type for n in model.graph.node if n.op_type != "Constant"]
    assert ops == ["ATen"] and model.graph.node[-1].output[0] == model.graph.output[0].name
    onnx.checker.check_model(model)
    x = torch.randn(64, 48, dtype=torch.float64).float().requires_grad_(True)
    reference = Formula()(x)
    torch.testing.assert_close(torch.ops.ortflow.gelu_tanh(x.detach()), reference.detach(), rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(reference)
    (expected,) = torch.autograd.grad(reference, x, grad)
    mine = torch.ops.ortflow.gelu_tanh_backward(grad, x.detach())
    torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)


@LEGACY_EXPORT
@EXPORTER_LOGGING
def test_a_formula_whose_intermediate_value_is_used_elsewhere_is_left_alone():
    model = exported(Formula(leak=True))
    before = [n.op_type for n in model.graph.node]
    assert aten_gelu.tanh_gelus_to_aten(model) == 0
    assert [n.op_type for n in model.graph.node] == before


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [p["train/loss"] for p in lines if "train/loss" in p]


def save_gpt2_without_dropout(folder: Path) -> Path:
    """A tiny random GPT-2 (gelu_new) with every dropout off, so that the engines' losses compare step by step."""
    import transformers

    torch.manual_seed(0)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = transformers.AutoConfig.for_model("gpt2", vocab_size=VOCAB, **SIZES["gpt2"], **no_dropout)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / "gpt2")
    return folder / "gpt2"


def lora(saved: Path, run_dir: Path, *extra: str) -> dict:
    overrides = ["model=hf", f"model.name_or_path={saved}", "+peft=lora", "peft.dropout=0.0", *TEXT]
    steps = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=0"]
    train([*overrides, *steps, *extra], run_dir=run_dir)
    return json.loads((run_dir / "run.json").read_text())


def assert_returns_loss_only_in_training(run_dir: Path) -> None:
    """The artifacts engine's training graph returns the loss only (no copy of the logits out of ORT each step); its
    eval graph still returns the logits, for the metrics."""
    graphs = {g: onnx.load(str(run_dir / "onnx" / f"{g}_model.onnx")) for g in ("training", "eval")}
    outputs = [o.name for o in graphs["training"].graph.output]  # the loss, then ORT's gradient accumulators
    assert "loss" in outputs[0] and "output" not in outputs
    assert "output" in {o.name for o in graphs["eval"].graph.output}


@pytest.mark.parametrize("mode", ["ortmodule", "artifacts"])
def test_gpt2_with_lora_in_bf16_runs_gelu_and_the_loss_by_torch_within_eager_bf16s_distance_from_fp32(mode, tmp_path):
    """bf16-mixed: GELU by torch and the LM head's GEMM and loss fused (accel/graph/aten_cross_entropy.py); fp32: ORT's
    own unless asked for (accel.aten_gelu, accel.aten_cross_entropy)."""
    saved = save_gpt2_without_dropout(tmp_path / "pretrained")
    lora(saved, tmp_path / "fp32", "accel=none")
    lora(saved, tmp_path / "eager", "accel=none", "trainer.precision=bf16-mixed")
    eager_fp32, eager_bf16 = np.array(losses(tmp_path / "fp32")), np.array(losses(tmp_path / "eager"))
    floor = np.abs(eager_bf16 - eager_fp32).max()
    assert floor > 0
    record = lora(saved, tmp_path / mode, f"accel={mode}", "trainer.precision=bf16-mixed")
    assert record["engine"]["executed_by"] == "onnxruntime"
    fixes = record["engine"]["graph_fixes"]
    assert fixes["gelus_run_by_torch"] == 2  # one per layer
    assert fixes["bf16_edges_through_gelus"] == 2  # c_fc hands bf16 through the GELU to c_proj
    assert fixes["lm_head_losses_fused_bf16"] == 1  # the training graph's: no fp32 logits, no ORT loss
    if mode == "artifacts":
        assert_returns_loss_only_in_training(tmp_path / mode)
    distance = np.abs(np.array(losses(tmp_path / mode)) - eager_bf16).max()
    assert distance <= floor, (distance, floor)
    fp32 = lora(saved, tmp_path / f"{mode}-fp32", f"accel={mode}")
    assert not {"gelus_run_by_torch", "cross_entropies_run_by_torch"} & set(fp32["engine"]["graph_fixes"])
    if mode == "artifacts":  # ORT's own loss block, the same outputs
        assert_returns_loss_only_in_training(tmp_path / f"{mode}-fp32")
    asked = ["accel.aten_gelu=true", "accel.aten_cross_entropy=true"]
    by_torch = lora(saved, tmp_path / f"{mode}-fp32-gelu", f"accel={mode}", *asked)
    fixes = by_torch["engine"]["graph_fixes"]  # asked for in fp32
    assert fixes["gelus_run_by_torch"] == 2 and fixes["cross_entropies_run_by_torch"] >= 1
    ort_own, torch_gelu = np.array(losses(tmp_path / f"{mode}-fp32")), np.array(losses(tmp_path / f"{mode}-fp32-gelu"))
    assert np.abs(torch_gelu - eager_fp32).max() <= max(1e-5, 2 * np.abs(ort_own - eager_fp32).max())
