"""bf16 handed through a gated MLP's SiLU-and-multiply (accel/graph/bf16_gated_edges.py): the nodes compute what
autocast computes, bit for bit, and both engines take the chain and pass the first-step check with it."""

import json

import onnx
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from ortflow import accel
from ortflow.accel.engine import EngineContext
from ortflow.accel.graph import bf16_gated_edges
from ortflow.config import BF16, OptimConfig
from tests.conftest import make_cfg

OPS = torch.ops.ortflow
FULL = [True, True, True, False, False]  # the gradients of a, b and bias; b not frozen; a arrives fp32
NO_BIAS = torch.zeros(0)


def test_the_nodes_compute_what_autocast_computes_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 32, generator=gen)
    wg, wu, wd = (torch.randn(*s, generator=gen) / 6 for s in ((96, 32), (96, 32), (32, 96)))
    grad = torch.randn(4, 8, 32, generator=gen)
    g16, x16, wg16 = OPS.gemm_bf16_out(x, wg, NO_BIAS, True, FULL)
    u16, _, wu16 = OPS.gemm_bf16_out(x, wu, NO_BIAS, True, FULL)
    m16 = OPS.silu_mul(g16, u16)
    out, m16_saved, wd16 = OPS.gemm_bf16(m16, wd, NO_BIAS, True, [*FULL[:4], True])
    grad_m, grad_wd, _ = OPS.gemm_bf16_backward(grad, m16_saved, wd16, NO_BIAS, True, [*FULL[:4], True])
    grad_g, grad_u = OPS.silu_mul_backward(grad_m, g16, u16)
    assert {t.dtype for t in (g16, u16, m16, grad_m, grad_g, grad_u)} == {torch.bfloat16}
    grad_x_g, grad_wg, _ = OPS.gemm_bf16_backward(grad_g, x16, wg16, NO_BIAS, True, FULL)
    grad_x_u, grad_wu, _ = OPS.gemm_bf16_backward(grad_u, x16, wu16, NO_BIAS, True, FULL)
    eager = {name: w.clone().requires_grad_() for name, w in (("g", wg), ("u", wu), ("d", wd))}
    eager_x = x.clone().requires_grad_()
    activation = eager_x * 1  # the MLP's input is a layer's output, not a leaf (autocast caches a leaf's bf16 copy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = F.silu(F.linear(activation, eager["g"])) * F.linear(activation, eager["u"])
        eager_out = F.linear(hidden, eager["d"])
    assert torch.equal(hidden, m16) and torch.equal(eager_out.float(), out)
    eager_out.backward(grad)
    for mine, theirs in ((grad_wg, eager["g"].grad), (grad_wu, eager["u"].grad), (grad_wd, eager["d"].grad)):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs)
    assert torch.equal(grad_x_g + grad_x_u, eager_x.grad)


class GatedMLP(nn.Module):
    """Llama's MLP, `down(silu(gate(x)) * up(x))`, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(32, 96, bias=False), nn.Linear(32, 96, bias=False)
        self.down_proj, self.head = nn.Linear(96, 32, bias=False), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.head(hidden.mean(1))


GRAPHS = {"artifacts": "training_model.onnx", "ortmodule": "model_post_processed_training.onnx"}


def _silu_mul_types(path) -> set[int]:
    graph = onnx.load(str(path)).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    nodes = [
        n
        for n in graph.node
        if any(a.name == "operator" and a.s.decode() == bf16_gated_edges.OPERATOR for a in n.attribute)
    ]
    assert len(nodes) == 1
    return {types.get(name, 0) for name in (*nodes[0].input, *nodes[0].output)}


@pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export")
@pytest.mark.parametrize("mode", ["artifacts", "ortmodule"])
def test_both_engines_hand_bf16_through_the_gated_mlp_and_pass_the_first_step_check(mode, tmp_path):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    example = (torch.randn(8, 16, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen))
    extra = ["debug=onnx"] if mode == "ortmodule" else []  # ORTModule saves its graphs
    cfg = make_cfg(f"accel={mode}", *extra)
    optim = OmegaConf.structured(OptimConfig())
    ctx = EngineContext(GatedMLP(), example, optim, debug=cfg.debug, onnx_dir=tmp_path, precision=BF16)
    engine = accel.build(cfg.accel, ctx)
    engine.train_step(*example)
    record = engine.describe()
    assert record["executed_by"] == "onnxruntime"
    assert record["graph_fixes"]["bf16_edges_through_gated_mlps"] == 1, record["graph_fixes"]
    assert record["first_step_check"]["status"] == "passed", record["first_step_check"]
    assert _silu_mul_types(tmp_path / GRAPHS[mode]) == {onnx.TensorProto.BFLOAT16}


@pytest.mark.parametrize("mode", ["artifacts", pytest.param("ortmodule", marks=pytest.mark.slow)])
def test_a_llama_fine_tuned_in_bf16_hands_bf16_through_every_layers_mlp(mode, tmp_path):
    """transformers' own Llama (LoRA on q and v, the MLPs frozen): each layer's MLP takes the chain, and the first-step
    check passes."""
    from tests.model.test_finetune import finetune, save_tiny

    finetune(save_tiny("llama", tmp_path), tmp_path / "run", f"accel={mode}", "trainer.precision=bf16-mixed")
    record = json.loads((tmp_path / "run" / "run.json").read_text())["engine"]
    assert record["executed_by"] == "onnxruntime" and record["ort_train_steps"] == 4
    assert record["graph_fixes"]["bf16_edges_through_gated_mlps"] == 2, record["graph_fixes"]  # two layers
    assert record["first_step_check"]["status"] == "passed", record["first_step_check"]
