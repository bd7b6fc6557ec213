"""ortflow-bench runs every requested mode and reports each measurement (structure only: no speed asserts)."""

import json
import math

import pytest

from ortflow.bench import main, summarize
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
    assert report["matmul_peak_gflops"] > 0


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
