"""scaled_dot_product_attention by torch's fused bf16 kernel inside ORT's graphs (accel/graph/aten_attention.py): the
nodes compute what eager's attention computes on autocast's bf16 query, key and value, bit for bit, and both engines
take it and pass the first-step check; dropout on the attention weights keeps the written-out graph."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from ortflow import accel
from ortflow.accel.engine import EngineContext
from ortflow.config import BF16, OptimConfig
from tests.conftest import make_cfg

OPS = torch.ops.ortflow
NO_MASK = torch.zeros(0, dtype=torch.bool)


@pytest.mark.parametrize("masking", ["causal", "boolean", "boolean-per-sample", "none"])
def test_the_nodes_compute_what_eagers_attention_computes_bit_for_bit(masking):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen) for _ in range(3))
    grad = torch.randn(2, 3, 16, 8, generator=gen)
    keep = torch.rand(2, 1, 16, 16, generator=gen) > 0.3 if masking == "boolean-per-sample" else None
    keep = torch.rand(16, 16, generator=gen) > 0.3 if keep is None else keep  # a padding mask / a shared one
    keep[..., 0] = True  # every row attends somewhere
    mask = keep if masking.startswith("boolean") else NO_MASK
    causal = masking == "causal"
    out, q16, k16, v16, out16, lse = OPS.attention_bf16(q, k, v, mask, causal, -1.0, [True, True, True])
    grads = OPS.attention_bf16_backward(grad, q16, k16, v16, out16, lse, mask, causal, -1.0, [True, False, True])
    eager = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    given = keep if masking.startswith("boolean") else None
    want = F.scaled_dot_product_attention(*eager, attn_mask=given, is_causal=causal)
    want.backward(grad.bfloat16())
    assert out.dtype == torch.float32 and torch.equal(out, want.float())
    assert torch.equal(grads[0], eager[0].grad.float()) and torch.equal(grads[2], eager[2].grad.float())
    assert grads[1] is None  # not asked for


class Attention(nn.Module):
    """One causal self-attention layer and a head, with attention-weights dropout `p`."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.qkv, self.out, self.head, self.p = nn.Linear(32, 96), nn.Linear(32, 32), nn.Linear(32, 10), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        p = self.p if self.training else 0.0
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(self.out(h).mean(1))


def _engine(mode: str, model: nn.Module, tmp_path, *overrides: str):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    example = (torch.randn(8, 16, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen))
    cfg = make_cfg(f"accel={mode}", *overrides)
    ctx = EngineContext(
        model, example, OmegaConf.structured(OptimConfig()), debug=cfg.debug, onnx_dir=tmp_path, precision=BF16
    )
    return accel.build(cfg.accel, ctx), example


@pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export")
@pytest.mark.parametrize("mode", ["artifacts", "ortmodule"])
def test_both_engines_run_attention_by_torchs_kernel_and_pass_the_first_step_check(mode, tmp_path):
    engine, example = _engine(mode, Attention(), tmp_path)
    engine.train_step(*example)
    engine.eval_step(*example)
    record = engine.describe()
    assert record["executed_by"] == "onnxruntime"
    assert record["graph_fixes"]["attentions_run_by_torch_bf16"] == 1, record["graph_fixes"]
    assert record["first_step_check"]["status"] == "passed", record["first_step_check"]


@pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export")
@pytest.mark.parametrize(
    "mode, model, overrides",
    [
        ("artifacts", lambda: Attention(p=0.1), []),
        ("ortmodule", lambda: Attention(p=0.1), []),
        ("ortmodule", Attention, ["accel.aten_attention=false"]),
    ],
    ids=["attention-dropout-artifacts", "attention-dropout-ortmodule", "setting-off"],
)
def test_attention_dropout_or_the_setting_off_keeps_the_written_out_attention(mode, model, overrides, tmp_path):
    engine, example = _engine(mode, model(), tmp_path, *overrides)
    engine.train_step(*example)
    record = engine.describe()
    assert record["executed_by"] == "onnxruntime"
    assert "attentions_run_by_torch_bf16" not in record["graph_fixes"], record["graph_fixes"]
