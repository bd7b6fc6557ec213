"""Training features in every accel mode: gradient accumulation against one larger batch, the gradient norm, best
and final weights, the inference ONNX export checked against onnxruntime, and ortflow-predict."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ortflow.run.runner import train
from tests.conftest import COMPILE_REFUSED, make_cfg

MODES = ["none", "ortmodule", "artifacts", "compile"]
DIGITS = [
    "+recipe=digits",
    "scheduler=constant",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "logger.progress=false",
]
# Measured: eager/ORTModule ~1e-7, artifacts ~2e-6 (ORT's AdamW graph) after 4 steps.
WEIGHT_TOL = {"none": 1e-5, "ortmodule": 1e-5, "artifacts": 1e-4, "compile": 1e-5}


def run(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    run_dir = tmp_path / name
    metrics = train(make_cfg(*DIGITS, *overrides), run_dir).metrics
    return metrics, run_dir


def points(run_dir: Path, key: str) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [p[key] for p in lines if key in p]


@pytest.mark.parametrize("mode", MODES)
def test_accumulating_n_batches_equals_one_step_on_a_batch_n_times_larger(mode, tmp_path):
    steps = ["trainer.max_steps=4", f"accel={mode}"]
    _, micro = run(tmp_path, "micro", *steps, "data.batch_size=16", "trainer.accumulate_grad_batches=4")
    _, large = run(tmp_path, "large", *steps, "data.batch_size=64")
    # The same samples: the loader's permutation does not depend on the batch size.
    np.testing.assert_allclose(points(micro, "train/loss"), points(large, "train/loss"), rtol=1e-5)
    np.testing.assert_allclose(points(micro, "train/grad_norm"), points(large, "train/grad_norm"), rtol=1e-4)
    a = torch.load(micro / "checkpoints" / "final.pt")
    b = torch.load(large / "checkpoints" / "final.pt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < WEIGHT_TOL[mode]


def test_the_gradient_norm_is_the_same_in_every_mode_and_is_taken_before_clipping(tmp_path):
    norms = {}
    for mode in [m for m in MODES if not (m == "compile" and COMPILE_REFUSED)]:  # refused below its verified torch
        # SGD: each step is linear in the gradient, so the modes' rounding differences do not grow (AdamW divides by
        # the gradient's own scale, which magnifies them on the components with gradients near 0).
        sgd = ["optim=sgd", "optim.weight_decay=0", "optim.lr=0.1"]
        _, run_dir = run(tmp_path, mode, "trainer.max_steps=3", f"accel={mode}", "trainer.grad_clip=0.01", *sgd)
        norms[mode] = points(run_dir, "train/grad_norm")
    assert all(n > 0.01 for n in norms["none"])  # above the clip: the logged norm is the unclipped one
    np.testing.assert_allclose(norms["ortmodule"], norms["none"], rtol=1e-4)
    np.testing.assert_allclose(norms["artifacts"], norms["none"], rtol=1e-4)
    if "compile" in norms:
        np.testing.assert_allclose(norms["compile"], norms["none"], rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_best_and_final_weights_and_the_inference_export(mode, tmp_path):
    import onnxruntime

    from ortflow.cli.predict import main as predict

    metrics, run_dir = run(
        tmp_path, mode, f"accel={mode}", "trainer.max_steps=40", "trainer.eval_every=10", "export.onnx=true"
    )
    record = json.loads((run_dir / "run.json").read_text())
    export = record["export"]
    assert export["max_abs_diff"] < 1e-4 and export["batch_sizes_checked"] == [64, 1], export
    # The example in docs/training.md: plain onnxruntime, any batch size.
    session = onnxruntime.InferenceSession(str(run_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": np.random.default_rng(0).random((5, 64), dtype=np.float32)})
    assert logits.shape == (5, 10)
    # best.pt holds the weights of the best evaluation: evaluating it gives that value again.
    assert (run_dir / "checkpoints" / "best.pt").is_file() and (run_dir / "checkpoints" / "final.pt").is_file()
    out = tmp_path / "predict.json"
    predict([str(run_dir), "--weights", "best", "--json", str(out)])
    assert json.loads(out.read_text())["eval/loss"] == pytest.approx(metrics["best/eval/loss"], rel=1e-4)


def test_a_resumed_accumulating_run_ends_bitwise_where_an_uninterrupted_one_does(tmp_path):
    steps = ["accel=none", "data.batch_size=16", "trainer.accumulate_grad_batches=3", "trainer.checkpoint.every=3"]
    steps.append("scheduler.warmup_steps=0")  # the lr schedule must not depend on max_steps here
    _, whole = run(tmp_path, "whole", *steps, "trainer.max_steps=6")
    run(tmp_path, "parts", *steps, "trainer.max_steps=3")
    _, parts = run(tmp_path, "parts", *steps, "trainer.max_steps=6", "trainer.resume=auto")
    a = torch.load(whole / "checkpoints" / "final.pt")
    b = torch.load(parts / "checkpoints" / "final.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert points(parts, "train/loss")[-3:] == points(whole, "train/loss")[-3:]


def test_predict_evaluates_a_text_file_and_samples_a_continuation(tmp_path, capsys):
    from ortflow.cli.predict import main as predict
    from tests.conftest import TINY

    run_dir = tmp_path / "lm"
    train(make_cfg("+recipe=transformer", *TINY, "trainer.max_steps=4"), run_dir)
    text = tmp_path / "notes.txt"
    text.write_text("a small text file to evaluate the language model on. " * 40)
    out = tmp_path / "text.json"
    predict([str(run_dir), "--text", str(text), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["split"] == f"text file {text}" and result["eval/loss"] > 0 and result["targets"] > 0
    capsys.readouterr()
    predict([str(run_dir), "--prompt", "The ", "--tokens", "20", "--weights", "final"])
    sampled = capsys.readouterr().out.rstrip("\n")
    assert sampled.startswith("The ") and len(sampled.encode(errors="replace")) >= 20
