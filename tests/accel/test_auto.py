"""accel=auto: the probe's choice is recorded and trains exactly as that engine would, the cache spares a second
probe, a resume keeps the choice, accel.* settings reach the chosen engine, configs exclude engines that refuse them."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ortflow.accel import auto, auto_cache, auto_decision, auto_probe
from ortflow.errors import OrtflowError
from ortflow.run.runner import build_data, build_model, engine_context, train
from tests.conftest import TINY, make_cfg

LM = [*TINY, "trainer.log_every=1", "trainer.eval_every=0", "trainer.max_steps=4"]
AUTO = ["accel=auto", "accel.probe_steps=1", "accel.budget_s=2"]


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
    assert auto.candidates(make_cfg("accel=auto", "distributed=ddp")) == ["none", "ortmodule", "compile"]
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


def test_the_median_interval_is_the_sign_tests():
    assert auto_decision.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)  # n = 5: the extremes (2/32 <= 0.1)
    ten = [float(v) for v in range(10, 0, -1)]
    assert auto_decision.median_interval(ten) == (2.0, 9.0)  # n = 10: P(B <= 1) = 11/1024 <= 0.05 < P(B <= 2)
    assert auto_decision.median_interval([1.0, 2.0, 3.0, 4.0]) == (0.0, float("inf"))  # too few for 90%


def probe(engine: str, ms: float | None, precision: str = "fp32") -> auto.Probe:
    return auto.Probe(engine, precision, step_ms=ms, error=None if ms else "refused")


def test_a_runoff_decides_between_the_two_fastest_and_equals_go_to_the_simpler_engine():
    probes = [probe("none", 11.0), probe("ortmodule", 12.0), probe("artifacts", 10.0)]
    assert auto.choose(probes).engine == "artifacts"  # no runoff: the first pass's fastest
    separated = auto.Runoff("artifacts fp32", "none fp32", pairs=9, ratio=1.2, low=1.1, high=1.3, verdict="separated")
    assert auto.choose(probes, separated).engine == "artifacts"
    flipped = auto.Runoff("artifacts fp32", "none fp32", pairs=9, ratio=0.8, low=0.7, high=0.9, verdict="separated")
    assert auto.choose(probes, flipped).engine == "none"
    equal = auto.Runoff("artifacts fp32", "none fp32", pairs=30, ratio=1.01, low=0.99, high=1.02, verdict="equal")
    assert auto.choose(probes, equal).engine == "none"  # eager is the simplest
    bf16 = [probe("artifacts", 10.0, "bf16-mixed"), probe("artifacts", 10.5)]
    assert (
        auto.choose(bf16, dataclasses.replace(equal, faster="artifacts bf16-mixed", other="artifacts fp32")) == bf16[1]
    )


def test_a_short_run_does_not_pick_an_engine_whose_start_up_costs_more_than_its_steps_save():
    """10% faster steps (10 vs 11 ms) for 20 s of compilation: worth it over 100,000 steps, not over 100."""
    probes = [
        dataclasses.replace(probe("none", 11.0), first_step_s=0.1),
        dataclasses.replace(probe("compile", 10.0), first_step_s=20.0),
    ]
    assert auto.choose(probes, steps=100).engine == "none"
    assert auto.choose(probes, steps=100_000).engine == "compile"
    assert auto.choose(probes).engine == "compile"  # the run's length unknown: step time alone
    slower_start = [dataclasses.replace(probes[0], first_step_s=30.0), probes[1]]
    assert auto.choose(slower_start, steps=100).engine == "compile"  # faster steps and the quicker start


class Plain:
    def __init__(self, executed_by: str) -> None:
        self.executed_by = executed_by

    def describe(self) -> dict:
        return {"executed_by": self.executed_by}


def test_a_candidate_counts_only_with_a_finite_loss_executed_as_it_should():
    assert auto_probe._not_as_it_should("ortmodule", Plain("onnxruntime"), 1.5) is None
    assert "executed by pytorch, not onnxruntime" in auto_probe._not_as_it_should("ortmodule", Plain("pytorch"), 1.5)
    assert "loss was nan" in auto_probe._not_as_it_should("artifacts", Plain("onnxruntime"), float("nan"))


@pytest.fixture
def measured(monkeypatch):
    """probe_one and runoff replaced by their results: (calls made, results to hand out)."""
    calls: list[str] = []
    results = {"none": 11.0, "ortmodule": None, "artifacts": 10.0}

    def probe_one(ctx, name, precision, settings, steps):
        calls.append(name)
        return probe(name, results[name], precision)

    def runoff(ctx, first, second, settings):
        calls.append("runoff")
        return auto.Runoff(first.label, second.label, pairs=5, ratio=1.2, low=1.1, high=1.3, verdict="separated")

    monkeypatch.setattr(auto, "probe_one", probe_one)
    monkeypatch.setattr(auto, "runoff", runoff)
    return calls, results


def test_eager_is_warmed_before_its_probe_so_that_its_start_up_is_its_own(monkeypatch, tmp_path):
    """auto_decision.weigh compares the engines' start-up (build and first step) for a short run; eager, probed first,
    carried the process's own first-use costs in it (1.76 s against ORTModule's build and export, 1.50 s)."""
    order: list[str] = []
    monkeypatch.setattr(auto, "warm_up", lambda ctx, name, precision, settings: order.append(f"warm {name}"))

    def probe_one(ctx, name, precision, settings, steps):
        order.append(name)
        return probe(name, 10.0, precision)

    monkeypatch.setattr(auto, "probe_one", probe_one)
    cfg = make_cfg(*LM, *AUTO)
    ctx = engine_context(cfg, build_model(cfg, data := build_data(cfg)), data, tmp_path)
    settings = {"cache": False, "probe_steps": 1, "budget_s": 0.0}
    auto.decide(ctx, settings, ["none", "ortmodule"], ["fp32"])
    assert order == ["warm none", "none", "ortmodule"]
    order.clear()
    auto.decide(ctx, settings, ["ortmodule", "artifacts"], ["fp32"])
    assert order == ["ortmodule", "artifacts"]  # no eager probe, nothing warmed: an ORT build is its own start-up


def test_failures_are_never_cached_and_a_cached_decision_spares_the_probe(measured, tmp_path):
    calls, results = measured
    cfg = make_cfg(*LM, *AUTO)
    ctx = engine_context(cfg, build_model(cfg, data := build_data(cfg)), data, tmp_path)
    settings = {"cache": True, "probe_steps": 1, "budget_s": 1.0}
    chosen, _, cached, _ = auto.decide(ctx, settings, ["none", "ortmodule", "artifacts"], ["fp32"])
    assert chosen.engine == "artifacts" and not cached and calls == ["none", "ortmodule", "artifacts", "runoff"]
    calls.clear()
    chosen, _, cached, _ = auto.decide(ctx, settings, ["none", "ortmodule", "artifacts"], ["fp32"])
    assert calls == ["ortmodule"] and not cached  # the failure is probed again, nothing else
    results["ortmodule"] = 12.0
    calls.clear()
    auto.decide(ctx, settings, ["none", "ortmodule", "artifacts"], ["fp32"])
    calls.clear()
    chosen, _, cached, _ = auto.decide(ctx, settings, ["none", "ortmodule", "artifacts"], ["fp32"])
    assert calls == [] and cached and chosen.engine == "artifacts"  # all ran once: the decision is cached
    key = auto_cache.cache_key(ctx, ["none", "ortmodule", "artifacts"], ["fp32"], settings)
    assert key != _key_with_version(ctx, settings, "0.0.0+other")  # another ortflow: another key


def _key_with_version(ctx, settings, version: str) -> str:
    saved = auto_cache.ortflow_version
    try:
        auto_cache.ortflow_version = lambda: version
        return auto_cache.cache_key(ctx, ["none", "ortmodule", "artifacts"], ["fp32"], settings)
    finally:
        auto_cache.ortflow_version = saved


def test_a_cached_choice_that_no_longer_builds_is_dropped_and_probed_again(measured, monkeypatch, tmp_path):
    calls, results = measured
    record = run(tmp_path / "first", *AUTO, "accel.candidates=[none,artifacts]")
    assert record["engine"]["auto"]["choice"]["accel"] == "artifacts"

    def refusing(*args, **kwargs):
        raise OrtflowError("injected: this engine cannot build the model any more")

    monkeypatch.setattr(auto.engines()["artifacts"], "build", refusing)
    results["artifacts"] = None  # and its probe fails too now
    calls.clear()
    record = run(tmp_path / "second", *AUTO, "accel.candidates=[none,artifacts]")
    assert calls == ["none", "artifacts"]  # the cached choice failed to build: dropped, probed again
    assert record["engine"]["auto"]["choice"]["accel"] == "none" and not record["engine"]["auto"]["choice"]["cached"]
