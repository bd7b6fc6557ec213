"""bf16 handed from GEMM to GEMM through a ReLU and a dropout mask (accel/graph/bf16_edges.py): the fused node
computes what the fp32-edged nodes computed, bit for bit, and what autocast computes; the trained graphs hold bf16
only on edges where eager autocast has bf16 too; both engines train to the same losses with and without it."""

import json

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ortflow.accel.graph import aten_gemm, bf16_edges, fed_dropout
from ortflow.run.runner import build_data, build_model, train
from ortflow.step import loss
from ortflow.step.batch import Layout
from ortflow.step.with_loss import WithLoss
from tests.accel.test_precision import losses
from tests.conftest import TINY, make_cfg

OPS = torch.ops.ortflow
NO = torch.zeros(0)  # no mask, no scale
LM = [*TINY, "trainer.log_every=1", "trainer.eval_every=0", "trainer.max_steps=4", "trainer.precision=bf16-mixed"]


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = 0.25
    keep = torch.rand(6, 4, 32, generator=gen) >= p
    return {
        "x": torch.randn(6, 4, 16, generator=gen),
        "w1": torch.randn(32, 16, generator=gen) / 4,
        "b1": torch.randn(32, generator=gen),
        "w2": torch.randn(8, 32, generator=gen) / 4,
        "b2": torch.randn(8, generator=gen),
        "mask": keep.float() * (1 / (1 - p)),  # a fed mask: 0 or 1 / (1 - p), as the engines draw them
        "keep": keep,
        "scale": torch.tensor(1 / (1 - p)),
        "grad": torch.randn(6, 4, 8, generator=gen),
    }


def test_the_fused_node_computes_what_the_fp32_edged_nodes_did_and_what_autocast_does():
    t = _tensors()
    full = [True, True, True, False, False]
    # The fp32 edges: GEMM (fp32 out) -> ReLU -> mask in ORT's fp32 -> GEMM (rounds its input to bf16).
    z, x16, w1_16 = OPS.gemm_bf16(t["x"], t["w1"], t["b1"], True, full)
    h32 = torch.relu(z) * t["mask"]
    out32, h16_in, w2_16 = OPS.gemm_bf16(h32, t["w2"], t["b2"], True, full)
    gh32, gw2, gb2 = OPS.gemm_bf16_backward(t["grad"], h16_in, w2_16, t["b2"], True, full)
    gz = gh32 * t["mask"] * (z > 0)
    gx, gw1, gb1 = OPS.gemm_bf16_backward(gz, x16, w1_16, t["b1"], True, full)
    # The bf16 edge: one node for GEMM, ReLU and mask, bf16 out; the next GEMM told its input arrives bf16.
    keep, scale = t["keep"].to(torch.uint8), t["scale"]  # the artifacts engine's feed: keep flags and the scale
    h16, fx16, fw1_16 = OPS.gemm_bf16_relu(t["x"], t["w1"], t["b1"], True, full, keep, scale)
    assert h16.dtype == torch.bfloat16 and torch.equal(h16, h16_in)
    out, _, fw2_16 = OPS.gemm_bf16(h16, t["w2"], t["b2"], True, [*full[:4], True])
    assert out.dtype == torch.float32 and torch.equal(out, out32)
    g16, fgw2, fgb2 = OPS.gemm_bf16_backward(t["grad"], h16, fw2_16, t["b2"], True, [*full[:4], True])
    assert g16.dtype == torch.bfloat16 and torch.equal(g16.float(), gh32)
    fgx, fgw1, fgb1 = OPS.gemm_bf16_relu_backward(g16, h16, keep, scale, fx16, fw1_16, t["b1"], True, full)
    for mine, theirs in ((fgw2, gw2), (fgb2, gb2), (fgx, gx), (fgw1, gw1)):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs)
    # The first bias's gradient sums the product's gradient as it now arrives, in bf16 (as autocast's bf16 backward
    # sums it), where the fp32 edges summed it in fp32.
    torch.testing.assert_close(fgb1, gb1, rtol=1e-2, atol=1e-2)
    # Autocast: linear in bf16, relu and dropout keep bf16 (dropout: x * keep * scale, rounded once); the gradients.
    b1 = t["b1"].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = torch.relu(F.linear(t["x"], t["w1"], b1)).mul(t["keep"]).mul_(float(t["scale"]))
    assert eager.dtype == torch.bfloat16 and torch.equal(h16, eager)
    eager.backward(g16)
    assert torch.equal(fgb1, b1.grad)
    # Without a mask (dropout off): an empty one.
    plain, _, _ = OPS.gemm_bf16_relu(t["x"], t["w1"], t["b1"], True, full, NO, NO)
    assert torch.equal(plain, torch.relu(z).to(torch.bfloat16))


def test_orts_module_takes_keep_flags_only_between_a_linears_relu_and_a_linear():
    cfg = make_cfg(*LM)
    data = build_data(cfg)
    model = WithLoss(build_model(cfg, data), loss.build(cfg.loss), Layout(1))
    example = (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    plain = fed_dropout.find_masks(model, example)
    flagged = fed_dropout.find_masks(model, example, keep_flags=True)
    assert [m.shape for m in plain] == [m.shape for m in flagged] and len(plain) == 4  # attention, 2 residuals, FFN
    assert [m.keep_flags for m in plain] == [False] * 4
    # Only the FFN's dropout (linear1 -> relu -> dropout -> linear2) takes keep flags: the others are read by adds.
    assert [m.keep_flags for m in flagged] == [False, False, True, False]
    assert flagged[2].shape[-1] == cfg.model.dim_feedforward


def _engine(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())["engine"]


def _edge_dtypes(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of each bf16 GEMM node's first input, by the module its node belongs to."""
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info)}
    found = {}
    for node in graph.node:
        operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), None)
        if operator in (aten_gemm.OPERATOR, bf16_edges.OPERATOR) and "/model/" in node.name:
            module = node.name.split("/model/", 1)[1].rsplit("/", 1)[0].replace("/", ".")
            found[module] = types.get(node.input[0], onnx.TensorProto.FLOAT)
    return found


def _autocast_dtypes() -> tuple[dict[str, torch.dtype], set[torch.dtype]]:
    """In one eager training forward under CPU autocast (dropout on): the dtype of every nn.Linear's input, and the
    dtypes torch's attention multiplies in (its bmm's)."""
    cfg = make_cfg(*LM)
    model = build_model(cfg, build_data(cfg)).train()
    inputs: dict[str, torch.dtype] = {}
    products: set[torch.dtype] = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0].dtype))

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
                products.add(args[1].dtype if func is torch.ops.aten.baddbmm.default else args[0].dtype)
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16), Products():
        model(torch.randint(0, 256, (2, 16)))
    return inputs, products


def _gemms(model: onnx.ModelProto) -> dict[str, int]:
    """How many forward GEMM nodes run in torch's bf16 (ATen) and in ORT's fp32 (MatMul, Gemm)."""
    operators = [next((a.s.decode() for a in n.attribute if a.name == "operator"), n.op_type) for n in model.graph.node]
    bf16 = sum(o in (aten_gemm.OPERATOR, bf16_edges.OPERATOR) for o in operators)
    return {"bf16": bf16, "fp32": sum(o in ("MatMul", "Gemm") for o in operators)}


# Both engines with dropout: the artifacts engine feeds the chain's mask as keep flags and a scale (graph inputs),
# ORTModule's module takes keep flags and multiplies by a constant scale (fed_dropout.py). ORTModule saves its graphs.
CASES = {"artifacts": [], "ortmodule": ["debug=onnx"]}
GRAPHS = {"artifacts": "forward.onnx", "ortmodule": "model_post_processed_training.onnx"}  # the forward graphs


def test_no_edge_is_bf16_where_autocast_has_fp32_and_both_engines_train_the_same_with_it(tmp_path):
    eager, products = _autocast_dtypes()
    # Torch's attention with dropout multiplies in fp32 under CPU autocast (its math path): so do both engines, the
    # same GEMMs in bf16 and in fp32 (the attention's two products: ORTModule's written-out attention's einsums).
    assert products == {torch.float32}
    gemms = {}
    run_losses = {}
    for mode, extra in CASES.items():
        for edges in ("true", "false"):
            run_dir = tmp_path / f"{mode}-{edges}"
            train(make_cfg(*LM, *extra, f"accel={mode}", f"accel.bf16_edges={edges}"), run_dir)
            engine = _engine(run_dir)
            assert engine["graph_plan"]["ops"]["bf16_edges"] == ("torch" if edges == "true" else "ort")
            fused = engine["graph_fixes"].get("bf16_edges_between_gemms", 0)
            assert fused == (1 if edges == "true" else 0), engine["graph_fixes"]  # TINY: one layer
            run_losses[mode, edges] = losses(run_dir)
            if edges == "true":
                gemms[mode] = _gemms(onnx.load(str(run_dir / "onnx" / GRAPHS[mode])))
            if mode == "artifacts":
                graph = _edge_dtypes(onnx.load(str(run_dir / "onnx" / "training_model.onnx")))
                bf16 = {m for m, t in graph.items() if t == onnx.TensorProto.BFLOAT16}
                assert bf16 == ({"transformer.layers.0.linear2"} if edges == "true" else set()), graph
                for module in bf16:  # never bf16 where autocast hands the GEMM fp32 (the residual stream)
                    assert eager[module] == torch.bfloat16, (module, eager)
                assert eager["transformer.layers.0.linear1"] == torch.float32  # after LayerNorm: fp32 in both
    assert gemms["ortmodule"] == gemms["artifacts"] and gemms["artifacts"]["fp32"] >= 2, gemms
    for mode in CASES:  # the same masks and the same forward arithmetic: the same first loss, bit for bit
        fused, unfused = run_losses[mode, "true"], run_losses[mode, "false"]
        assert len(fused) == 4 and fused[0] == unfused[0], run_losses
        # After an update: the first GEMM's bias gradient is summed from bf16 as autocast sums it (from fp32 without
        # the fused chain), a rounding apart; measured 1.2e-5 relative by the fourth step.
        assert fused[1:] == pytest.approx(unfused[1:], rel=1e-4, abs=0), run_losses


@pytest.mark.parametrize("mode", ["artifacts"])
def test_fp32_runs_have_no_bf16_edges(mode, tmp_path):
    train(make_cfg(*LM[:-1], "trainer.precision=fp32", f"accel={mode}"), tmp_path / mode)
    engine = _engine(tmp_path / mode)
    assert engine["graph_plan"]["ops"]["bf16_edges"] == "ort"
    assert "bf16_edges_between_gemms" not in engine["graph_fixes"]
