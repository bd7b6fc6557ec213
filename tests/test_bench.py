"""ortflow-bench runs every requested mode and reports each measurement (structure only: no speed asserts)."""

import json
import math

import pytest

from ortflow.cli.bench import main, summarize
from tests.conftest import TINY


@pytest.mark.slow
def test_bench_reports_every_mode_with_its_ratio_to_eager(tmp_path):
    out = tmp_path / "bench.json"
    tiny = [o for o in TINY if not o.startswith(("trainer.", "logger."))]
    variant = "artifacts:accel.rewrite_gathers=false"  # a mode with its own overrides (before/after comparisons)
    modes = f"none,ortmodule,artifacts,{variant}"
    main(["--modes", modes, "--steps", "3", "--warmup", "1", "--repeats", "1", "--out", str(out), *tiny])
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"none", "ortmodule", "artifacts", variant}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["none"]["vs_eager"] == 1.0
    assert {rows[m]["executed_by"] for m in ("ortmodule", "artifacts", variant)} == {"onnxruntime"}
    for r in rows.values():
        assert 0 < r["mfu"] < 1 and r["peak_rss_mb"] > 0 and r["first_step_s"] > 0
        assert math.isfinite(r["loop_outside_engine"])  # measured in the same steps as the engine's time
    peaks = report["matmul_peaks_gflops"]  # MFU is against the faster runtime's matmul
    assert set(peaks) == {"torch", "onnxruntime"} and report["matmul_peak_gflops"] == max(peaks.values()) > 0


def test_a_failed_mode_is_reported_not_hidden():
    runs = [
        {
            "setting": "-",
            "mode": "none",
            "samples_per_s": 10.0,
            "first_step_s": 1,
            "peak_rss_mb": 1,
            "runner_overhead": 0.0,
            "loop_outside_engine": 0.0,
            "flops_per_step": 1e6,
            "batch_size": 2,
            "executed_by": "pytorch",
        },
        {"setting": "-", "mode": "compile", "error": "no compiler"},
    ]
    rows = {r["mode"]: r for r in summarize(runs, peak_gflops=1.0)}
    assert rows["compile"]["error"] == "no compiler" and rows["none"]["vs_eager"] == 1.0


@pytest.mark.slow
def test_bench_profile_puts_orts_operators_beside_torchs(tmp_path):
    out = tmp_path / "profile.json"
    tiny = [o for o in TINY if not o.startswith(("trainer.", "logger."))]
    main(
        ["--profile", "--modes", "none,ortmodule,artifacts", "--steps", "3", "--warmup", "1", "--out", str(out), *tiny]
    )
    profiles = {p["mode"]: p for p in json.loads(out.read_text())["profiles"]}
    assert set(profiles) == {"none", "ortmodule", "artifacts"}
    assert all("error" not in p for p in profiles.values()), profiles
    eager = {r["op"]: r for r in profiles["none"]["torch_ops"]}
    assert profiles["none"]["ort_ops"] == [] and eager["aten::addmm"]["ms_per_step"] > 0
    for mode in ("ortmodule", "artifacts"):
        ort = {r["op"]: r for r in profiles[mode]["ort_ops"]}
        # One encoder layer: two LayerNorms, each differentiated once per step (the first step and warm-up left out).
        assert ort["LayerNormalizationGrad"]["calls_per_step"] == 2, mode
        assert all(r["ms_per_step"] >= 0 for r in ort.values())
        assert profiles[mode]["executed_by"] == "onnxruntime"
        assert "Dropout" not in ort  # every dropout is a multiply by the masks ortflow draws (rewrite_dropout)
        ranges = {r["op"]: r for r in profiles[mode]["torch_ops"]}
        assert (
            ranges["ortflow::draw_dropout_masks"]["calls_per_step"] == 1
            and not ranges["ortflow::draw_dropout_masks"]["ort_run"]
        )
        ort_run = "_ORTModuleFunction" if mode == "ortmodule" else "ortflow::ort_training_graph"
        assert ranges[ort_run]["ort_run"]  # its self time is ORT's: marked, and left out of torch's total


def test_ort_profile_is_reduced_per_operator_and_step_without_the_first_runs(tmp_path):
    from ortflow.report.profile import ort_ops

    def event(node: str, op: str, dur: int, ts: int) -> dict:
        return {"cat": "Node", "name": f"{node}_kernel_time", "dur": dur, "ts": ts, "args": {"op_name": op}}

    trace = [event("mm1", "MatMul", d, ts) for ts, d in enumerate([900, 200, 300])]
    trace += [event("mm2", "MatMul", d, ts) for ts, d in enumerate([900, 100, 100])]
    trace += [event("relu", "Relu", d, ts) for ts, d in enumerate([50, 40, 60])]
    trace += [{"cat": "Session", "name": "model_run", "dur": 5000, "ts": 0}]
    (tmp_path / "ort_profile_1.json").write_text(json.dumps(trace))
    rows = ort_ops(tmp_path, skip_runs=1, steps=2)
    assert rows == [
        {"op": "MatMul", "ms_per_step": 0.35, "calls_per_step": 2.0},
        {"op": "Relu", "ms_per_step": 0.05, "calls_per_step": 1.0},
    ]


@pytest.mark.slow
def test_bench_sweeps_are_plotted_one_panel_per_swept_key(tmp_path):
    from matplotlib.image import imread

    from ortflow.report.plots import COLORS, DPI, PANEL_SIZE

    out = tmp_path / "sweep.json"
    tiny = [o for o in TINY if not o.startswith(("trainer.", "logger."))]
    sweeps = ["--sweep", "data.batch_size=4,8", "--sweep", "model.d_model=16,32"]
    main(["--modes", "none", "--steps", "2", "--warmup", "0", "--repeats", "1", *sweeps, "--out", str(out), *tiny])
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows] == [
        "data.batch_size=4",
        "data.batch_size=8",
        "model.d_model=16",
        "model.d_model=32",
    ]
    image = imread(out.with_suffix(".png"))
    assert image.shape[1] == 2 * PANEL_SIZE[0] * DPI  # two panels side by side
    colour = [int(COLORS[0][i : i + 2], 16) / 255 for i in (1, 3, 5)]
    drawn = (abs(image[..., :3] - colour).sum(axis=-1) < 0.05).any(axis=0)
    half = image.shape[1] // 2
    assert drawn[:half].any() and drawn[half:].any()  # eager's curve in each panel
