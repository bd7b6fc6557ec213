"""bf16 handed through GELU from GEMM to GEMM (accel/graph/bf16_gelu_edges.py), on GPT-2's MLP as transformers
writes it (Conv1D: addmm through views; gelu_new's formula): both engines hand bf16 along the chain and pass the
first-step check, with the weights' gradients what the fp32 edges gave (the GELU's gradient in bf16 is torch's fp32
computation rounded once, as the next GEMM rounded it before)."""

import math

import onnx
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ortflow import accel
from ortflow.accel.engine import EngineContext
from ortflow.accel.graph import aten_gelu, bf16_gelu_edges
from ortflow.config import BF16, OptimConfig
from tests.accel.graph.test_aten_gelu import EXPORTER_LOGGING, LEGACY_EXPORT, Formula
from tests.conftest import make_cfg


class Conv1D(nn.Module):
    """GPT-2's Conv1D: bias + x @ W, through a 2-D view and back."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) / math.sqrt(nx))
        self.bias = nn.Parameter(torch.randn(nf) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = (*x.size()[:-1], self.weight.size(1))
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.act, self.c_proj = Conv1D(32, 128), Formula(), Conv1D(128, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c_proj(self.act(self.c_fc(x))).mean(1))


def _engine(mode: str, edges: bool, tmp):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    example = (torch.randn(8, 16, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen))
    extra = ["debug=onnx"] if mode == "ortmodule" else []  # ORTModule saves its graphs
    cfg = make_cfg(f"accel={mode}", f"accel.bf16_edges={str(edges).lower()}", *extra)
    optim = OmegaConf.structured(OptimConfig())
    ctx = EngineContext(MLP(), example, optim, debug=cfg.debug, onnx_dir=tmp / f"{mode}-{edges}", precision=BF16)
    engine = accel.build(cfg.accel, ctx)
    engine.train_step(*example)  # the first-step check: the engine's gradients against eager autocast's
    return engine


GRAPHS = {"artifacts": "training_model.onnx", "ortmodule": "model_post_processed_training.onnx"}


def _gelu_types(path) -> set[int]:
    """The element types of the GELU nodes' inputs and outputs and of their gradient nodes' outputs."""
    graph = onnx.load(str(path)).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    found = set()
    for node in graph.node:
        operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), None)
        if operator in (aten_gelu.OPERATOR, aten_gelu.BACKWARD):
            found |= {types.get(node.input[0], 0), types.get(node.output[0], 0)}
    return found


@LEGACY_EXPORT
@EXPORTER_LOGGING
@pytest.mark.parametrize("mode", ["artifacts", "ortmodule"])
def test_gpt2s_mlp_hands_bf16_through_gelu_with_the_weights_gradients_of_the_fp32_edges(mode, tmp_path):
    errors = {}
    for edges in (True, False):
        engine = _engine(mode, edges, tmp_path)
        record = engine.describe()
        assert record["executed_by"] == "onnxruntime"
        assert record["graph_fixes"].get("bf16_edges_through_gelus", 0) == int(edges), record["graph_fixes"]
        assert record["graph_fixes"]["gelus_run_by_torch"] == 1
        want = {onnx.TensorProto.BFLOAT16} if edges else {onnx.TensorProto.FLOAT}
        assert _gelu_types(tmp_path / f"{mode}-{edges}" / GRAPHS[mode]) == want
        check = record["first_step_check"]
        assert check["status"] == "passed", check
        errors[edges] = {w["parameter"]: w["error"] for w in check["worst"]}
    # The weights' distances from eager's gradients are the same, to the bit: so are their gradients. The biases' are
    # summed from the bf16 gradient now, as autocast sums them, a rounding apart.
    weights = [p for p in errors[True] if p.endswith("weight")]
    assert "c_fc.weight" in weights and weights == [p for p in errors[False] if p.endswith("weight")], errors
    assert all(errors[True][p] == errors[False][p] for p in weights), errors


def test_a_chain_with_a_second_reader_is_left_alone():
    """The GELU's output also read elsewhere (here: a graph output) keeps its fp32 edges."""
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("ATen", ["x", "w", "b", "t", "m"], ["z", "z1", "z2"], operator="ortflow::gemm_bf16"),
            onnx.helper.make_node("ATen", ["z"], ["g"], operator=aten_gelu.OPERATOR),
            onnx.helper.make_node(
                "ATen", ["g", "w2", "b2", "t", "m"], ["y", "y1", "y2"], operator="ortflow::gemm_bf16"
            ),
        ],
        "chain",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("x", "w", "b", "w2", "b2")],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("y", "g")],
    )
    model = onnx.helper.make_model(graph)
    graph = model.graph
    assert bf16_gelu_edges.gemm_gelu_chains(model) == 0
    graph.output.pop()  # g read by the second GEMM alone: the chain is taken
    assert bf16_gelu_edges.gemm_gelu_chains(model) == 1
    assert graph.node[1].input[0] == graph.node[0].output[0] == "z/bf16"
    assert graph.node[2].input[0] == "g/bf16"
