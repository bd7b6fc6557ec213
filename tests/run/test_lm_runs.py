"""Runs on BPE-tokenized text: every accel mode trains on it with the model's vocabulary following the tokenizer,
reports eval/bits_per_byte, keeps its tokenizer in the run dir; an eager resume is bitwise; ortflow-predict encodes
and decodes with the run's tokenizer."""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from ortflow.cli import predict
from ortflow.data.tokens.store import MANIFEST
from tests.conftest import TINY


def bpe(tmp_path: Path) -> list[str]:
    return ["data.tokenizer=bpe", "data.bpe_vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}"]


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


@pytest.mark.parametrize("accel", ["none", pytest.param("ortmodule", marks=pytest.mark.slow), "artifacts"])
def test_a_bpe_run_in_each_accel_mode_follows_the_tokenizer_and_reports_bits_per_byte(accel, tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(*TINY, *bpe(tmp_path), f"accel={accel}", "hydra.run.dir=run", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    run = tmp_path / "run"
    info = record(run)
    manifest = json.loads((run / "data_manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "bpe" and info["data"]["vocab_size"] == manifest["tokenizer"]["vocab_size"]
    weights = torch.load(run / "checkpoints" / "final.pt", weights_only=True)
    assert weights["embedding.weight"].shape[0] == manifest["tokenizer"]["vocab_size"]  # the model follows
    val = manifest["splits"]["val"]
    metrics = info["metrics"]
    expected = metrics["eval/loss"] * val["tokens"] / val["bytes"] / math.log(2)
    assert metrics["eval/bits_per_byte"] == pytest.approx(expected, rel=1e-6)
    assert hashlib.sha256((run / "tokenizer.json").read_bytes()).hexdigest() == manifest["tokenizer"]["sha256"]
    assert (Path(info["data"]["prepared"]) / MANIFEST).is_file()  # prepared in the cache, not in the run dir
    if accel != "none":
        assert info["engine"]["executed_by"] == "onnxruntime"


def test_an_eager_bpe_run_resumes_bitwise(tmp_path, ortflow_cli):
    args = [*TINY, *bpe(tmp_path), "trainer.max_steps=8", "trainer.checkpoint.every=4"]
    status, stderr = ortflow_cli(*args, "hydra.run.dir=whole", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    saved = torch.load(tmp_path / "whole" / "checkpoints" / "step-00000004.pt", weights_only=True)
    assert saved["data"]["source"]["kind"] == "random_blocks" and saved["data"]["source"]["position"] == 4
    step4 = tmp_path / "whole" / "checkpoints" / "step-00000004.pt"
    status, stderr = ortflow_cli(*args, f"trainer.resume={step4}", "hydra.run.dir=resumed", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    a = torch.load(tmp_path / "whole" / "checkpoints" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "checkpoints" / "final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert record(tmp_path / "resumed")["metrics"]["eval/loss"] == record(tmp_path / "whole")["metrics"]["eval/loss"]


def test_predict_encodes_and_decodes_with_the_runs_tokenizer(tmp_path, ortflow_cli, capfd):
    status, stderr = ortflow_cli(*TINY, *bpe(tmp_path), "hydra.run.dir=run", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    run = tmp_path / "run"
    capfd.readouterr()
    predict.main([str(run), "--prompt", "The lambda ", "--tokens", "5", "--weights", "final"])
    out = capfd.readouterr().out
    assert out.startswith("The lambda ") and len(out.strip()) > len("The lambda")

    text = tmp_path / "notes.txt"
    text.write_text("Some other text, evaluated with the run's own tokenizer. " * 40)
    predict.main([str(run), "--text", str(text), "--json", str(tmp_path / "m.json"), "--weights", "final"])
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["targets"] > 0 and math.isfinite(metrics["eval/loss"])
    run_tokenizer = hashlib.sha256((run / "tokenizer.json").read_bytes()).hexdigest()
    stores = [json.loads(p.read_text()) for p in (tmp_path / "cache").rglob(MANIFEST)]
    for_text = [m for m in stores if m["source"]["spec"] == str(text)]
    assert [m["tokenizer"]["sha256"] for m in for_text] == [run_tokenizer]  # --text used the run's tokenizer


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli(*TINY, *bpe(tmp_path), "model.vocab_size=256", cwd=tmp_path)
    assert status == 2 and "model.vocab_size=256 is smaller than the data's vocabulary" in stderr
