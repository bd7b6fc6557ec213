"""ortflow-bench: every requested mode measured and reported (structure only: no speed asserts), the step count
chosen from a time budget, results kept after every measurement and resumed, other libraries' notices in the log."""

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console

from ortflow.bench.plan import Measurement, plan, settings_of
from ortflow.bench.progress import Reporter
from ortflow.bench.records import FORMAT, jsonable, machine_facts
from ortflow.bench.start import CALIBRATION_S, choose_steps
from ortflow.bench.summary import summarize
from ortflow.bench.tables import rate, table
from ortflow.cli.bench import main, parse_args
from tests.conftest import TINY

REPO = Path(__file__).resolve().parents[2]
TINY_BENCH = [o for o in TINY if not o.startswith(("trainer.", "logger."))]
# What other libraries print: torch.utils.cpp_extension's import (also `import onnxruntime`'s), ONNX Runtime's
# native log lines, Python warnings.
FOREIGN = ("No CUDA runtime is found", ":onnxruntime:", "Warning:")


def _bench(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m ortflow.cli.bench ARGS` from a scratch directory, stdout and stderr together, read line by line;
    killed if it runs longer than 10 minutes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ortflow.cli.bench", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(600, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    return proc


def _until(proc: subprocess.Popen, pattern: str) -> list[str]:
    """The process's lines up to the first matching `pattern` (all of them if none does)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            break
    return lines


def _record(args: list[str], **extra) -> dict:
    return {"format": FORMAT, "args": jsonable(vars(parse_args(args))), "machine": machine_facts(), **extra}


def test_the_budget_chooses_more_steps_for_a_faster_step():
    def steps_for(step_s: float, budget: float, **kw) -> dict:
        now = [0.0]

        def clock() -> float:
            return now[0]

        def step() -> None:
            now[0] += step_s

        return choose_steps(step, budget, min_steps=5, passes=4, clock=clock, **kw)

    fast, slow = steps_for(0.002, 10.0), steps_for(0.3, 10.0)
    assert fast["steps"] > slow["steps"] >= 5
    # Calibration until min(CALIBRATION_S, budget / 10); the rest of the budget shared by the passes.
    for chosen, step_s in ((fast, 0.002), (slow, 0.3)):
        calibrated = chosen["calibration_steps"] * step_s
        assert calibrated >= CALIBRATION_S and calibrated - step_s < CALIBRATION_S
        assert abs(chosen["steps"] - (10.0 - calibrated) / (4 * step_s)) <= 1  # floored; the fake clock's float sums
    assert steps_for(5.0, 10.0)["steps"] == 5  # a step longer than the budget: min_steps, one calibration step
    assert steps_for(5.0, 10.0)["calibration_steps"] == 1
    assert steps_for(0.002, 10.0, max_steps=50)["steps"] == 50


def test_sweep_takes_plain_overrides_after_it_and_modes_alternate():
    line = "--sweep model.d_model=128,256,512 model.num_layers=4 data.block_size=128"
    args = parse_args([*line.split(), "--modes", "none,ortmodule,artifacts", "--repeats", "2"])
    assert args.overrides == ["model.num_layers=4", "data.block_size=128"]
    assert settings_of(args) == ["model.d_model=128", "model.d_model=256", "model.d_model=512"]
    measurements = plan(args)
    assert len(measurements) == 3 * 3 * 2 and [m.index for m in measurements] == list(range(1, 19))
    first = [(m.mode, m.repeat) for m in measurements[:6]]  # each repeat starts one mode later
    assert first == [(m, 1) for m in ("none", "ortmodule", "artifacts")] + [
        (m, 2) for m in ("ortmodule", "artifacts", "none")
    ]
    for bad in (["--sweep", "model.d_model"], ["--sweep", "model.d_model=1,,2"], ["model.d_model"], ["--budget", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_named_workloads_and_no_recipe_compose_model_hf_configs_for_every_mode(capsys):
    from ortflow.bench.plan import check_configs, mode_config, overrides_for

    def config(*argv: str, mode: str = "artifacts:trainer.precision=bf16-mixed"):
        args = parse_args(list(argv))
        check_configs(args)  # every mode in every precision composes and validates
        return mode_config(mode, overrides_for(args, "-"))

    gpt2 = config("--workload", "gpt2-124m", "--precision", "fp32,bf16-mixed", "data.batch_size=2")
    assert gpt2.model.model_type == "gpt2" and gpt2.trainer.precision == "bf16-mixed"
    assert (gpt2.model.config.n_layer, gpt2.model.config.n_embd, gpt2.data.block_size) == (12, 768, 256)
    assert gpt2.data.batch_size == 2  # an override after the workload wins over its own
    qwen = config("--workload", "qwen2-lora")
    assert (qwen.model.model_type, qwen.model.config.num_key_value_heads, qwen.peft.r) == ("qwen2", 2, 8)
    assert config("--workload", "d512").model.d_model == 512
    # A model=hf config of the user's own, with no recipe whose model keys it would have to carry.
    own = config("--recipe", "none", "model=hf", "model.model_type=gpt2", "++model.config.n_layer=3", mode="none")
    assert own.model.config.n_layer == 3 and own.model.model_type == "gpt2"
    with pytest.raises(SystemExit):
        parse_args(["--workload", "d512", "--recipe", "digits"])
    assert "--workload d512 names its own recipe" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--workload", "gpt5"])
    assert "gpt2-124m" in capsys.readouterr().err  # the choices, named


@pytest.mark.slow
def test_bench_measures_a_model_hf_config_with_lora_in_an_ort_engine(tmp_path):
    out = tmp_path / "hf.json"
    model = ["model=hf", "model.model_type=gpt2", "++model.config.n_layer=1", "++model.config.n_embd=32"]
    model += ["++model.config.n_head=2", "+peft=lora", "data.block_size=16", "data.batch_size=4"]
    timing = ["--modes", "none,artifacts", "--steps", "2", "--warmup", "0", "--repeats", "1"]
    main(["--recipe", "none", *timing, "--out", str(out), *model])
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["artifacts"]["executed_by"] == "onnxruntime"
    for run in report["runs"]:  # LoRA: the adapters train, the GPT-2 weights do not
        assert 0 < run["parameters"]["trainable"] < run["parameters"]["total"], run


def test_resume_refuses_other_arguments_and_other_files(tmp_path, capsys):
    out = tmp_path / "bench.json"
    started = ["--recipe", "digits", "--modes", "none", "--budget", "2", "--out", str(out), "model.hidden=[32]"]
    out.write_text(json.dumps(_record(started, runs=[])))
    with pytest.raises(SystemExit) as refused:
        main(["--resume", str(out), "--budget", "5", "model.hidden=[16]"])
    message = str(refused.value)
    assert "--budget 5.0 differs from the bench's --budget 2.0" in message
    assert "overrides model.hidden=[16] differs from the bench's overrides model.hidden=[32]" in message
    other = json.loads(out.read_text())
    other["machine"]["torch"] = "0.0.1"
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"it was measured with torch 0\.0\.1"):
        main(["--resume", str(tmp_path / "other.json")])
    (tmp_path / "not-a-bench.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a file ortflow-bench can continue"):
        main(["--resume", str(tmp_path / "not-a-bench.json")])
    with pytest.raises(SystemExit, match="cannot read it"):
        main(["--resume", str(tmp_path / "missing.json")])


def test_progress_is_plain_lines_off_a_terminal_and_a_bar_on_one(tmp_path):
    plan_ = [Measurement(i + 1, "-", mode, 1, 1) for i, mode in enumerate(("none", "artifacts", "none"))]
    run = {"samples_per_s": 100.0, "passes": 4, "steps": 20, "first_step_s": 0.5}
    plain = io.StringIO()
    reporter = Reporter(Console(file=plain, width=200), plan_, [], tmp_path / "b.log")
    reporter.start(plan_[0])
    reporter.end(plan_[0], {**run, "setting": "-", "mode": "none", "wall_s": 30.0})
    reporter.start(plan_[1])
    reporter.end(plan_[1], {"setting": "-", "mode": "artifacts", "error": "ValueError: no\ndetails", "wall_s": 10.0})
    reporter.close()
    lines = plain.getvalue().splitlines()
    assert "\x1b" not in plain.getvalue()
    assert lines[0] == "[1/3] none, repeat 1/1 ..."
    # ETA: each measurement left takes what the finished ones of its mode took (a mode not measured yet: all's mean).
    done = "[1/3] none, repeat 1/1: 100 samples/s (4 x 20 steps timed, first step 0.5 s) in 30 s; bench 0:"
    assert lines[1].startswith(done) and lines[1].endswith(", ETA 1:00")
    failed = f"[2/3] artifacts, repeat 1/1: failed: ValueError: no (see {tmp_path / 'b.log'}) in 10 s; bench 0:"
    assert lines[3].startswith(failed) and lines[3].endswith(", ETA 0:30")
    tty = io.StringIO()
    reporter = Reporter(Console(file=tty, force_terminal=True, width=120), plan_, [], tmp_path / "b.log")
    reporter.start(plan_[0])
    reporter.close()
    assert "\x1b[" in tty.getvalue() and "[1/3] none, repeat 1/1 ..." in tty.getvalue()


def test_eta_takes_each_measurement_left_as_long_as_its_setting_and_mode_took(tmp_path):
    done = [
        {"setting": "d=64", "mode": "none", "wall_s": 10.0},
        {"setting": "d=64", "mode": "artifacts", "wall_s": 20.0},
        {"setting": "d=512", "mode": "none", "wall_s": 100.0},
    ]
    todo = [
        Measurement(4, "d=512", "none", 2, 2),  # as d=512's none: 100
        Measurement(5, "d=512", "artifacts", 1, 2),  # no d=512 artifacts yet: artifacts anywhere, 20
        Measurement(6, "d=512", "compile", 1, 2),  # a mode not measured yet: the mean of all, 130 / 3
    ]
    reporter = Reporter(Console(file=io.StringIO()), todo, done, tmp_path / "b.log")
    assert reporter.eta() == pytest.approx(100 + 20 + 130 / 3)
    assert reporter.elapsed() >= 130  # the earlier sessions' measurements count in the bench's elapsed time


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
            "parameters": {"total": 3_000_000, "trainable": 20_000},
        },
        {"setting": "-", "mode": "compile", "error": "no compiler"},
    ]
    summary = summarize(runs, peak_gflops=1.0)
    rows = {r["mode"]: r for r in summary}
    assert rows["compile"]["error"] == "no compiler" and rows["none"]["vs_eager"] == 1.0
    assert rows["none"]["trainable_params"] == 20_000  # LoRA against full fine-tuning: what trains
    console = Console(width=200, record=True)
    console.print(table(summary, "bench"))
    text = console.export_text()
    assert "0.02M" in text and "10 (10-10)" in text
    assert rate(0.4771) == "0.48" and rate(123.4) == "123"


def test_scaling_plot_takes_values_that_are_not_numbers(tmp_path):
    from matplotlib.image import imread

    from ortflow.report.plots import COLORS, DPI, PANEL_SIZE, plot_scaling

    rows = [
        {
            "setting": f"accel.rewrite_relu={v}",
            "mode": "none",
            "samples_per_s": s,
            "samples_per_s_min": s,
            "samples_per_s_max": s,
        }
        for v, s in (("true", 100.0), ("false", 50.0))
    ]
    image = imread(plot_scaling(rows, tmp_path / "scaling.png"))
    assert image.shape[1] == PANEL_SIZE[0] * DPI
    colour = [int(COLORS[0][i : i + 2], 16) / 255 for i in (1, 3, 5)]
    assert (abs(image[..., :3] - colour).sum(axis=-1) < 0.05).any()


@pytest.mark.slow
def test_bench_reports_every_mode_with_its_ratio_to_eager(tmp_path):
    out = tmp_path / "bench.json"
    variant = "artifacts:accel.rewrite_gathers=false"  # a mode with its own overrides (before/after comparisons)
    modes = f"none,ortmodule,{variant},compile"  # the plain artifacts mode: the profile test below
    main(["--modes", modes, "--steps", "3", "--warmup", "1", "--repeats", "1", "--out", str(out), *TINY_BENCH])
    report = json.loads(out.read_text())
    assert report["complete"]
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"none", "ortmodule", variant, "compile"}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["none"]["vs_eager"] == 1.0
    assert {rows[m]["executed_by"] for m in ("ortmodule", variant)} == {"onnxruntime"}
    assert rows["compile"]["executed_by"] == "inductor"  # torch.compile's engine, proven by its compiled runs
    for r in rows.values():
        assert 0 < r["mfu"] < 1 and r["peak_rss_mb"] > 0 and r["first_step_s"] > 0
        assert r["steps"] == 3  # --steps overrides the budget
        assert math.isfinite(r["loop_outside_engine"])  # measured in the same steps as the engine's time
    for run in report["runs"]:  # ORT's own counters: the first step, the warm-up and 2 x 2 passes of 3 steps
        if run["executed_by"] == "onnxruntime":
            assert run["engine"]["ort_train_steps"] == 1 + 1 + 4 * 3, run
        if run["executed_by"] == "inductor":  # and the loop's final evaluation, compiled too
            assert run["engine"]["compiled_steps"] == 1 + 1 + 4 * 3, run
    peaks = report["matmul_peaks_gflops"]  # MFU is against the faster runtime's matmul
    assert set(peaks) == {"torch", "onnxruntime"} and report["matmul_peak_gflops"] == max(peaks.values()) > 0


@pytest.mark.slow
def test_bench_profile_puts_orts_operators_beside_torchs(tmp_path):
    out = tmp_path / "profile.json"
    main(
        [
            "--profile",
            "--modes",
            "none,ortmodule,artifacts",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--out",
            str(out),
            *TINY_BENCH,
        ]
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
    for mode in profiles:  # fp32: nothing converts to or from a 16-bit float, in any engine
        assert profiles[mode]["conversions"]["total"] == {"count": 0.0, "mb": 0.0, "ms": 0.0}, mode
        kinds = profiles[mode]["by_kind"]  # the step by kind of work: every millisecond once
        assert kinds["GEMM"] > 0 and kinds["conversions"] == 0, (mode, kinds)
        assert sum(kinds.values()) == pytest.approx(profiles[mode]["step_ms"]), (mode, kinds)
    for mode in ("ortmodule", "artifacts"):
        assert profiles[mode]["by_kind"]["dropout masks"] > 0, mode  # ortflow's masks, drawn by torch


def test_a_profiled_step_is_split_by_kind_of_work_counting_orts_torch_kernels_once():
    from ortflow.bench.categories import by_kind

    result = {
        "step_ms": 100.0,
        "torch_ops": [
            {"op": "aten::mm", "ms_per_step": 30.0},  # run by ORT's ATen node: torch's time is the work
            {"op": "aten::copy_", "ms_per_step": 6.0},  # 4 of them converting dtypes (below)
            {"op": "aten::bernoulli_", "ms_per_step": 5.0},
            {"op": "aten::_fused_adamw_", "ms_per_step": 4.0},
            {"op": "autograd::engine::evaluate_function: MmBackward0", "ms_per_step": 1.0},
            {"op": "_ORTModuleFunction", "ms_per_step": 50.0, "ort_run": True},  # ORT's: its kernels below
        ],
        "ort_ops": [
            {"op": "ATen", "ms_per_step": 33.0},  # the aten::mm above and the node's own overhead
            {"op": "FusedMatMul", "ms_per_step": 10.0},
            {"op": "SoftmaxGrad_13", "ms_per_step": 3.0},
            {"op": "LayerNormalizationGrad", "ms_per_step": 7.0},
            {"op": "Cast", "ms_per_step": 2.0},
        ],
        "conversions": {"total": {"ms": 5.0}},
    }
    kinds = by_kind(result)
    assert kinds == {
        "GEMM": 40.0,
        "attention": 3.0,
        "conversions": 5.0,
        "element-wise": 10.0,  # LayerNormalizationGrad 7, the copies and Casts that keep their dtype 3
        "dropout masks": 5.0,
        "optimizer": 4.0,
        "framework ranges": 1.0,
        "outside kernels": 32.0,  # the step's wall time no operator accounts for
    }


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


def test_dtype_conversions_are_counted_wherever_they_run_and_copies_that_keep_the_dtype_are_not(tmp_path):
    """torch's: every aten::copy_ between a 16-bit float and another (a .to(), autocast's casts), by count, bytes read
    and written, and self time; ORT's: its Cast nodes between such types, the first runs left out."""
    import torch

    from ortflow.report.profile import ort_conversions, torch_conversions

    x = torch.ones(1000, 100)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            x.to(torch.bfloat16).to(torch.float32)  # two conversions of 100,000 values a step
            x.clone()  # a copy that keeps the dtype
            x.to(torch.int64)  # not between floats
            x.to(torch.float64)  # between floats, but no 16-bit one: a scalar's float64 step count, say
    got = torch_conversions(prof, steps=2)
    assert got["count"] == 2 and got["mb"] == pytest.approx(2 * 100_000 * (4 + 2) / 1e6) and got["ms"] > 0

    def cast(node: str, source: str, target: str, ts: int) -> dict:
        args = {"op_name": "Cast", "input_type_shape": [{source: [10, 20]}], "output_type_shape": [{target: [10, 20]}]}
        return {"cat": "Node", "name": f"{node}_kernel_time", "dur": 100, "ts": ts, "args": args}

    trace = [cast("to_bf16", "float", "bfloat16", ts) for ts in range(3)]
    trace += [cast("to_int", "float", "int64", ts) for ts in range(3)]
    trace += [cast("same", "float", "float", ts) for ts in range(3)]
    trace += [cast("wide", "float", "double", ts) for ts in range(3)]
    (tmp_path / "ort_profile_1.json").write_text(json.dumps(trace))
    assert ort_conversions(tmp_path, skip_runs=1, steps=2) == {"count": 1.0, "mb": 200 * 6 / 1e6, "ms": 0.1}


@pytest.mark.slow
def test_a_killed_bench_keeps_its_measurements_and_resume_runs_only_the_rest(tmp_path):
    import torch

    out = tmp_path / "bench.json"
    args = ["--recipe", "digits", "--modes", "none,artifacts", "--repeats", "1", "--budget", "0.2", "--out", str(out)]
    proc = _bench(tmp_path, *args)
    lines = _until(proc, r"^\[1/2\] .*samples/s")  # the first measurement's end line
    assert out.is_file(), lines
    proc.send_signal(signal.SIGKILL)  # no chance to write anything more
    proc.wait()
    kept = json.loads(out.read_text())
    assert not kept["complete"] and [(r["mode"], r["repeat"]) for r in kept["runs"]] == [("none", 1)], lines
    assert [r["mode"] for r in kept["rows"]] == ["none"]

    resumed = _bench(tmp_path, "--resume", str(out))
    output = resumed.stdout.read()
    assert resumed.wait() == 0, output
    assert "1 of 2 measurements done, 1 to run" in output
    assert not re.search(r"^\[1/2\]", output, re.M) and re.search(r"^\[2/2\] .*samples/s", output, re.M)
    report = json.loads(out.read_text())
    assert report["complete"] and report["resumed"] == 1
    assert report["runs"][0] == kept["runs"][0]  # not measured again
    keys = [(r["mode"], r["repeat"]) for r in report["runs"]]
    assert sorted(keys) == [("artifacts", 1), ("none", 1)]
    assert {r["mode"]: r["repeats"] for r in report["rows"]} == {"none": 1, "artifacts": 1}
    # Other libraries' notices (ORT's native log lines, torch.utils.cpp_extension's import, warnings) go to the log.
    assert not [line for line in output.splitlines() if any(f in line for f in FOREIGN)], output
    log = out.with_suffix(".log").read_text()
    assert ":onnxruntime:" in log  # ONNX Runtime's native lines, from the measurements' processes
    if not torch.cuda.is_available():
        assert "No CUDA runtime is found" in log


@pytest.mark.slow
def test_sigterm_stops_the_bench_and_its_measurement(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--recipe", "digits", "--modes", "none", "--repeats", "2", "--budget", "30", "--out", str(out)]
    proc = _bench(tmp_path, *args)
    lines = _until(proc, r"^\[1/2\] .*\.\.\.$")  # the first measurement has started
    log = out.with_suffix(".log")
    for _ in range(100):  # its process is running once the bench has written its pid
        if "==== pid" in log.read_text():
            break
        threading.Event().wait(0.1)
    worker = int(re.search(r"==== pid (\d+)", log.read_text())[1])
    proc.send_signal(signal.SIGTERM)
    lines += proc.stdout.readlines()
    assert proc.wait() == 128 + signal.SIGTERM, lines
    assert f"continue with: ortflow-bench --resume {out}" in "".join(lines)
    assert not Path(f"/proc/{worker}").exists()  # ended (and reaped) with the bench
    assert json.loads(out.read_text())["runs"] == []


@pytest.mark.slow
def test_a_sweep_gives_a_faster_model_more_steps_and_writes_its_png(tmp_path):
    from matplotlib.image import imread

    from ortflow.report.plots import COLORS, DPI, PANEL_SIZE

    out = tmp_path / "sweep.json"
    tiny = [o for o in TINY_BENCH if not o.startswith(("model.d_model", "model.dim_feedforward"))]
    proc = _bench(
        tmp_path,
        *["--modes", "none", "--repeats", "1", "--budget", "2", "--min-steps", "1", "--out", str(out)],
        *["--sweep", "model.d_model=16,256", "model.dim_feedforward=1024", *tiny],  # plain overrides after --sweep
        env={"OMP_NUM_THREADS": "1"},  # step time follows the model's size even on a busy machine
    )
    output = proc.stdout.read()
    assert proc.wait() == 0, output
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["model.d_model=16", "model.d_model=256"]
    assert rows["model.d_model=16"]["steps"] > rows["model.d_model=256"]["steps"], rows
    image = imread(out.with_suffix(".png"))
    assert image.shape[1] == PANEL_SIZE[0] * DPI  # one swept key: one panel
    colour = [int(COLORS[0][i : i + 2], 16) / 255 for i in (1, 3, 5)]
    assert (abs(image[..., :3] - colour).sum(axis=-1) < 0.05).any()  # eager's curve
