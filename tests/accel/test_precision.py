"""trainer.precision=bf16-mixed in every engine: torch's bf16 GEMM nodes against autocast, parity per engine against
eager's own bf16-vs-fp32 difference, ORT's counters, resume, the CPU facts and the bench's precision columns."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from ortflow import machine
from ortflow.accel.graph import aten_gemm  # noqa: F401  (registers ortflow::gemm_bf16)
from ortflow.run.runner import train
from ortflow.validate import problems
from tests.conftest import TINY, make_cfg

# A tiny language model without dropout (the engines' losses then compare step for step).
LM = [*TINY, "model.dropout=0.0", "trainer.log_every=1", "trainer.eval_every=0", "trainer.max_steps=4"]


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [p["train/loss"] for p in lines if "train/loss" in p]


def run(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    run_dir = tmp_path / name
    outcome = train(make_cfg(*LM, *overrides), run_dir)
    return outcome.metrics, run_dir


def test_the_bf16_gemm_node_computes_what_autocast_computes_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    w = torch.randn(8, 16, generator=gen, requires_grad=True)
    b = torch.randn(8, generator=gen, requires_grad=True)
    grad = torch.randn(3, 5, 8, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, w, b)
    expected.float().backward(grad)
    out, x16, w16 = torch.ops.ortflow.gemm_bf16(x.detach(), w.detach(), b.detach(), True, [True, True, True])
    torch.testing.assert_close(out, expected.float(), rtol=0, atol=0)  # the same bf16 kernel, the same rounding
    assert x16.dtype == w16.dtype == torch.bfloat16  # the copies the gradient node takes
    gx, gw, gb = torch.ops.ortflow.gemm_bf16_backward(grad, x16, w16, b.detach(), True, [True] * 3)
    for mine, theirs in ((gx, x.grad), (gw, w.grad), (gb, b.grad)):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-2)  # bf16 GEMMs on both sides
    # A frozen weight gets no weight-gradient GEMM; a batched matmul's gradients reduce to its operands' shapes.
    gx, gw, gb = torch.ops.ortflow.gemm_bf16_backward(grad, x16, w16, b.detach(), True, [True, False, False])
    assert gw is None and gb is None and gx.shape == x.shape
    a, m = torch.randn(2, 4, 6, generator=gen).bfloat16(), torch.randn(1, 6, 3, generator=gen).bfloat16()
    ga, gm, _ = torch.ops.ortflow.gemm_bf16_backward(torch.ones(2, 4, 3), a, m, torch.zeros(0), False, [True] * 3)
    assert ga.shape == a.shape and gm.shape == m.shape


def test_bf16_in_the_ort_engines_stays_within_eager_bf16s_own_distance_from_fp32(tmp_path):
    """The issue's parity rule: an ORT engine's bf16 losses differ from eager bf16's by no more than eager bf16's
    differ from eager fp32's over the same steps; ORT's counters prove ORT ran every step with torch's bf16 GEMMs."""
    _, fp32 = run(tmp_path, "fp32", "accel=none")
    _, eager = run(tmp_path, "eager", "accel=none", "trainer.precision=bf16-mixed")
    eager_fp32, eager_bf16 = np.array(losses(fp32)), np.array(losses(eager))
    floor = np.abs(eager_bf16 - eager_fp32).max()
    assert floor > 0  # bf16 really computed something else than fp32
    for mode in ("ortmodule", "artifacts"):
        metrics, run_dir = run(tmp_path, mode, f"accel={mode}", "trainer.precision=bf16-mixed", "export.onnx=true")
        record = json.loads((run_dir / "run.json").read_text())
        # export.onnx is the fp32 inference graph, ORT's own operators only (checked against torch by the run).
        assert not any(n.op_type == "ATen" for n in onnx.load(str(run_dir / "model.onnx")).graph.node)
        assert record["precision"] == "bf16-mixed" and metrics["precision"] == "bf16-mixed"
        assert record["engine"]["ort_train_steps"] == 4 and metrics["executed_by"] == "onnxruntime"
        assert record["engine"]["graph_fixes"]["matmuls_run_by_torch_bf16"] >= 4  # attention, feed-forward, head
        distance = np.abs(np.array(losses(run_dir)) - eager_bf16).max()
        print(f"{mode}: bf16 vs eager bf16 {distance:.2e}; eager bf16 vs fp32 {floor:.2e}")
        assert distance <= floor, mode


@pytest.mark.parametrize("mode", ["none", "artifacts"])
def test_a_bf16_run_resumed_from_its_checkpoint_continues_exactly(mode, tmp_path):
    common = [f"accel={mode}", "trainer.precision=bf16-mixed", "trainer.checkpoint.every=2"]
    _, whole = run(tmp_path, "whole", *common)
    run(tmp_path, "cut", *common, "trainer.max_steps=2")
    _, resumed = run(tmp_path, "cut", *common, "trainer.resume=auto")
    assert losses(resumed)[-2:] == pytest.approx(losses(whole)[-2:], rel=1e-6)
    final = torch.load(resumed / "checkpoints" / "final.pt")
    assert all(v.dtype != torch.bfloat16 for v in final.values())  # checkpoints hold fp32 weights


@pytest.mark.parametrize("mode", ["ortmodule", "artifacts"])
def test_convolutions_train_in_bf16_in_the_ort_engines(mode, tmp_path):
    vision = ["model=resnet", "data=images", "data.train_images=64", "data.val_images=16", "data.batch_size=8"]
    vision += ["model.blocks=[1]", "model.width=8", "trainer.max_steps=3", "trainer.eval_batches=1"]
    vision += ["logger.progress=false", "trainer.log_every=1", "trainer.eval_every=0"]
    run_dir = tmp_path / mode
    train(make_cfg(*vision, f"accel={mode}", "trainer.precision=bf16-mixed"), run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["engine"]["ort_train_steps"] == 3
    assert record["engine"]["graph_fixes"]["convolutions_run_by_torch_bf16"] >= 3


def test_an_unknown_precision_is_refused_naming_the_key():
    found = problems(make_cfg("trainer.precision=fp16"))
    assert any("trainer.precision='fp16'" in p and "bf16-mixed" in p for p in found)


def test_auto_precision_follows_the_cpus_bf16_units_and_emulation_is_said(monkeypatch):
    monkeypatch.setattr(machine, "bf16_units", lambda: False)
    assert machine.resolve_precision("auto") == "fp32"
    assert "no bf16 units" in machine.emulation_warning("bf16-mixed")
    monkeypatch.setattr(machine, "bf16_units", lambda: True)
    monkeypatch.setattr(machine, "bf16_matmul_speedup", lambda: 2.0)
    assert machine.resolve_precision("auto") == "bf16-mixed"
    assert machine.emulation_warning("bf16-mixed") is None
    assert machine.emulation_warning("fp32") is None


def test_the_bench_measures_every_mode_in_each_precision_and_compares_within_it():
    from ortflow.bench.plan import mode_specs
    from ortflow.bench.summary import summarize
    from ortflow.bench.tables import mode_label
    from ortflow.cli.bench import parse_args

    args = parse_args(["--precision", "fp32,bf16-mixed", "--modes", "none,artifacts:accel.aten_conv=false"])
    specs = mode_specs(args)
    assert specs == [
        "none",
        "artifacts:accel.aten_conv=false",
        "none:trainer.precision=bf16-mixed",
        "artifacts:accel.aten_conv=false;trainer.precision=bf16-mixed",
    ]
    run = {"executed_by": "x", "steps": 1, "first_step_s": 1, "peak_rss_mb": 1, "runner_overhead": 0}
    run |= {"loop_outside_engine": 0, "flops_per_step": 1, "batch_size": 1, "setting": "-", "repeat": 1}
    rates = dict(zip(specs, (10.0, 12.0, 16.0, 24.0), strict=True))
    rows = {r["mode"]: r for r in summarize([run | {"mode": m, "samples_per_s": v} for m, v in rates.items()], 1.0)}
    assert rows[specs[3]]["vs_eager"] == pytest.approx(2.4)
    assert rows[specs[3]]["vs_eager_same_precision"] == pytest.approx(1.5)
    assert "vs_eager_same_precision" not in rows["none"]
    assert [mode_label(m) for m in specs[1:]] == [
        "artifacts:accel.aten_conv=false",
        "none bf16-mixed",
        "artifacts:accel.aten_conv=false bf16-mixed",
    ]
