"""accel=auto: the probe's choice is recorded and trains exactly as that engine would, the cache spares a second
probe, a resume keeps the choice, accel.* settings reach the chosen engine, configs exclude engines that refuse them."""

import json
from pathlib import Path

import pytest
import torch

from ortflow.accel import auto
from ortflow.run.runner import train
from tests.conftest import TINY, make_cfg

LM = [*TINY, "trainer.log_every=1", "trainer.eval_every=0", "trainer.max_steps=4"]
AUTO = ["accel=auto", "accel.probe_steps=1"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def run(run_dir: Path, *overrides: str) -> dict:
    train(make_cfg(*LM, *overrides), run_dir)
    return json.loads((run_dir / "run.json").read_text())


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [p["train/loss"] for p in lines if "train/loss" in p]


def test_auto_records_its_choice_and_trains_bit_for_bit_as_the_chosen_engine(tmp_path):
    record = run(tmp_path / "auto", *AUTO, "accel.candidates=[none,artifacts]")
    choice = record["engine"]["auto"]["choice"]
    probed = {(p["engine"], p["precision"]) for p in record["engine"]["auto"]["probes"]}
    assert probed == {("none", "fp32"), ("artifacts", "fp32")} and choice["accel"] in ("none", "artifacts")
    assert all(p["step_ms"] > 0 for p in record["engine"]["auto"]["probes"])
    assert record["engine"]["engine"] == choice["accel"] and record["precision"] == choice["precision"] == "fp32"
    direct = tmp_path / "direct"
    run(direct, f"accel={choice['accel']}")
    assert losses(tmp_path / "auto") == losses(direct)  # the probe's steps touched nothing of the run
    a, b = (torch.load(d / "checkpoints" / "final.pt") for d in (tmp_path / "auto", direct))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The same model and batch again: the cached probe, no second measurement.
    again = run(tmp_path / "again", *AUTO, "accel.candidates=[none,artifacts]")
    assert again["engine"]["auto"]["choice"]["cached"] is True
    assert again["engine"]["auto"]["choice"]["accel"] == choice["accel"]


def test_a_resumed_auto_run_keeps_its_choice_and_settings_reach_the_chosen_engine(tmp_path):
    common = [*AUTO, "accel.rewrite_relu=false", "trainer.checkpoint.every=2"]
    first = run(tmp_path / "run", *common, "accel.candidates=[artifacts]", "trainer.max_steps=2")
    assert first["engine"]["auto"]["choice"]["accel"] == "artifacts"
    assert "relu_to_mask_mul" not in first["engine"]["graph_fixes"]  # accel.rewrite_relu=false reached artifacts
    resumed = run(tmp_path / "run", *common, "accel.candidates=[none]", "trainer.resume=auto")
    assert resumed["engine"]["engine"] == "artifacts" and resumed["engine"]["auto"]["choice"]["resumed"] is True
    assert resumed["engine"]["auto"]["probes"] == []


def test_engines_the_config_rules_out_are_not_probed_and_a_config_none_can_run_is_refused():
    assert auto.candidates(make_cfg("accel=auto", "distributed=ddp")) == ["none", "ortmodule"]
    found = auto.problems(make_cfg("accel=auto", "distributed=ddp", "accel.candidates=[artifacts]"))
    assert found and "artifacts" in found[0] and "data parallelism" in found[0]
    assert "not engines" in auto.problems(make_cfg("accel=auto", "accel.candidates=[fast]"))[0]


def test_trainer_precision_auto_probes_bf16_only_on_a_cpu_with_bf16_units(monkeypatch):
    monkeypatch.setattr(auto.machine, "bf16_units", lambda: True)
    assert auto.precisions("auto") == ["fp32", "bf16-mixed"]
    monkeypatch.setattr(auto.machine, "bf16_units", lambda: False)
    assert auto.precisions("auto") == ["fp32"]
    assert auto.precisions("bf16-mixed") == ["bf16-mixed"]


def test_trainer_precision_auto_measures_the_engine_in_both_precisions_where_the_cpu_has_bf16_units(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(auto.machine, "bf16_units", lambda: True)
    record = run(tmp_path / "units", "accel=artifacts", "trainer.precision=auto")
    choice = record["engine"]["auto"]["choice"]
    assert choice["by"] == "trainer.precision=auto" and record["engine"]["engine"] == "artifacts"
    assert {(p["engine"], p["precision"]) for p in record["engine"]["auto"]["probes"]} == {
        ("artifacts", "fp32"),
        ("artifacts", "bf16-mixed"),
    }
    assert record["precision"] == choice["precision"]
    monkeypatch.setattr(auto.machine, "bf16_units", lambda: False)
    record = run(tmp_path / "none", "accel=artifacts", "trainer.precision=auto")
    assert record["precision"] == "fp32" and record["engine"]["auto"]["probes"] == []  # nothing to choose: no probe
