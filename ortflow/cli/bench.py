"""`ortflow-bench`: one recipe in every accel mode (and torch.compile as a reference), modes alternating, repeated.

Reports per mode: samples/s (median and min-max over repeats) and its ratio to eager measured in the same run,
time to first step (export + session creation; ORTModule's extension build excluded), peak resident memory,
model FLOP utilisation against a matmul peak measured in the same run, and the runner's overhead two ways: "vs
bare" compares ortflow's loop with a bare hand-written loop on the same engine (alternating pairs; as noisy as
two timings), "outside" is the time ortflow's loop spends outside the engine's calls, relative to the time inside
them, measured in the same steps. Prints a table and writes JSON. A benchmark, not a test: it asserts no speed.

    ortflow-bench                                    # transformer recipe, all modes, 3 repeats
    ortflow-bench --sweep model.d_model=64,128,256   # scaling with model width
    ortflow-bench --sweep data.batch_size=16,32,64 --modes none,ortmodule
    ortflow-bench --sweep model.d_model=64,128,256 --sweep data.batch_size=16,32,64   # one PNG, a panel per sweep
    ortflow-bench --profile                          # top operators per step: ORT's profiler beside torch.profiler
    ortflow-bench --modes 'none,ortmodule,ortmodule:accel.rewrite_gathers=false;accel.allow_spinning=true'
                                                     # a mode with its own overrides: before/after in one run
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ortflow.accel.extensions import ensure_built
from ortflow.cli.bench_worker import MODES
from ortflow.report.plots import plot_scaling
from ortflow.report.profile import total_ms


def matmul_peak_gflops(n: int = 1024, repeats: int = 20) -> dict[str, float]:
    """Best fp32 n x n matmul throughput on this machine in GFLOP/s, of torch and of ONNX Runtime (each with its
    default thread count): the peak model FLOP utilisation is measured against is the higher of the two, so that
    a runtime with faster matmuls cannot show more than 100%.

    Measured before and after the runs (main takes the higher): on a shared machine one short measurement can
    land in a slow moment."""
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    torch_best = min(_timed(lambda: a @ b) for _ in range(repeats))
    spec = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [n, n]) for name in ("a", "b", "c")]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul", spec[:2], spec[2:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=onnx.IR_VERSION_2023_5_5)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"a": a.numpy(), "b": b.numpy()}
    out = np.empty((n, n), np.float32)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("c", "cpu", 0, np.float32, [n, n], out.ctypes.data)
    for _ in range(3):
        session.run_with_iobinding(binding)
    ort_best = min(_timed(lambda: session.run_with_iobinding(binding)) for _ in range(repeats))
    return {"torch": 2 * n**3 / torch_best / 1e9, "onnxruntime": 2 * n**3 / ort_best / 1e9}


def _peaks_text(peaks: dict[str, float]) -> str:
    return ", ".join(f"{name} {gflops:.0f} GFLOP/s" for name, gflops in peaks.items())


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_worker(mode: str, steps: int, warmup: int, overrides: list[str], profile: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ortflow.cli.bench_worker", *(["--profile"] if profile else [])]
    cmd += [mode, str(steps), str(warmup), *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in result.stdout.splitlines():
        if line.startswith("ORTFLOW-BENCH "):
            return json.loads(line.removeprefix("ORTFLOW-BENCH "))
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    return {"mode": mode, "error": lines[-1][:200] if lines else f"exit code {result.returncode}"}


def summarize(runs: list[dict[str, Any]], peak_gflops: float) -> list[dict[str, Any]]:
    """One row per (setting, mode): medians over repeats and the ratio to eager in the same setting."""
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == setting]
        for mode in dict.fromkeys(r["mode"] for r in mine):
            ok = [r for r in mine if r["mode"] == mode and "error" not in r]
            row: dict[str, Any] = {"setting": setting, "mode": mode, "repeats": len(ok)}
            if not ok:
                row["error"] = next(r["error"] for r in mine if r["mode"] == mode)
                rows.append(row)
                continue
            sps = [r["samples_per_s"] for r in ok]
            median = statistics.median(sps)
            row |= {
                "executed_by": ok[0]["executed_by"],
                "samples_per_s": median,
                "samples_per_s_min": min(sps),
                "samples_per_s_max": max(sps),
                "first_step_s": statistics.median(r["first_step_s"] for r in ok),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in ok),
                "runner_overhead": statistics.median(r["runner_overhead"] for r in ok),
                "loop_outside_engine": statistics.median(r["loop_outside_engine"] for r in ok),
                "mfu": ok[0]["flops_per_step"] * median / ok[0]["batch_size"] / (peak_gflops * 1e9),
            }
            rows.append(row)
        eager = next((r for r in rows if r["setting"] == setting and r["mode"] == "none" and "error" not in r), None)
        for r in rows:
            if r["setting"] == setting and eager and "error" not in r:
                r["vs_eager"] = r["samples_per_s"] / eager["samples_per_s"]
    return rows


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    columns = (
        "setting",
        "mode",
        "samples/s (min-max)",
        "x eager",
        "first step",
        "peak RSS",
        "MFU",
        "vs bare",
        "outside",
    )
    for col in columns:
        t.add_column(col, justify="left" if col in ("setting", "mode") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["setting"], r["mode"], f"failed: {r['error']}", *[""] * 6)
            continue
        t.add_row(
            r["setting"],
            r["mode"],
            f"{r['samples_per_s']:.0f} ({r['samples_per_s_min']:.0f}-{r['samples_per_s_max']:.0f})",
            f"{r['vs_eager']:.2f}" if "vs_eager" in r else "-",
            f"{r['first_step_s']:.1f} s",
            f"{r['peak_rss_mb']:.0f} MB",
            f"{100 * r['mfu']:.1f}%",
            f"{100 * r['runner_overhead']:+.1f}%",
            f"{100 * r['loop_outside_engine']:.2f}%",
        )
    return t


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ortflow-bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--recipe", default="transformer", help="recipe to benchmark (default: transformer)")
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, from {','.join(MODES)}; MODE:k=v;k2=v2 gives a mode its own overrides",
    )
    p.add_argument("--steps", type=int, default=30, help="timed training steps per measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after the first one")
    p.add_argument("--repeats", type=int, default=3, help="measurements per mode (modes alternate)")
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        help="KEY=V1,V2,...: repeat everything for each value (scaling); may be given more than once; writes a PNG",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: each mode's top operators per step, ORT's profiler beside torch.profiler",
    )
    p.add_argument("--top", type=int, default=10, help="operators shown per mode with --profile (JSON keeps all)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default: outputs/bench/<time>.json)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run, e.g. model.num_layers=4")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted({m for m in modes if m.partition(":")[0] not in MODES})
    if unknown:
        raise SystemExit(f"ortflow-bench: unknown mode(s) {unknown}; choose from {MODES}")
    if any(m.startswith("ortmodule") for m in modes):
        ensure_built()  # the one-time build is not part of any measurement
    console = Console(width=None if sys.stdout.isatty() else 140)
    settings = [f"{key}={v}" for key, _, values in (x.partition("=") for x in args.sweep) for v in values.split(",")]
    settings = settings or [""]
    if args.profile:
        profile_modes(args, modes, settings, console)
        return
    peaks = matmul_peak_gflops()
    console.print(f"fp32 matmul peak: {_peaks_text(peaks)}")
    runs = []
    for setting in settings:
        overrides = [f"+recipe={args.recipe}", *args.overrides, *([setting] if setting else [])]
        for repeat in range(args.repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:  # rotate the order
                console.print(f"[dim]{setting or 'recipe defaults'}: {mode}, repeat {repeat + 1}/{args.repeats}[/dim]")
                runs.append({**run_worker(mode, args.steps, args.warmup, overrides), "setting": setting or "-"})
    peaks = {k: max(v, after) for (k, v), after in zip(peaks.items(), matmul_peak_gflops().values(), strict=True)}
    peak = max(peaks.values())
    console.print(
        f"fp32 matmul peak, best of before and after the runs: {_peaks_text(peaks)}; MFU is against {peak:.0f}"
    )
    rows = summarize(runs, peak)
    machine = machine_facts()
    console.print(table(rows, f"ortflow-bench: +recipe={args.recipe}, {args.steps} steps x {args.repeats} repeats"))
    console.print(f"machine: {describe_machine(machine)}")
    out = args.out or Path("outputs") / "bench" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "args": vars(args) | {"out": str(out)},
        "machine": machine,
        "matmul_peak_gflops": peak,
        "matmul_peaks_gflops": peaks,
        "rows": rows,
    }
    out.write_text(json.dumps(report | {"runs": runs}, indent=2))
    console.print(f"written: {out}")
    if args.sweep:
        title = f"ortflow-bench +recipe={args.recipe}: {describe_machine(machine)}"
        console.print(f"written: {plot_scaling(rows, out.with_suffix('.png'), title)}")


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo, with AVX-512 noted: it decides which runtime's matmuls are
    faster), else what `platform` knows."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    name = fields.get("model name", platform.machine())
    return f"{name}, AVX-512" if "avx512f" in fields.get("flags", "").split() else name


def describe_machine(machine: dict[str, Any]) -> str:
    return (
        f"{machine['cpu']} ({machine['cpu_count']} cores), torch {machine['torch']}, "
        f"onnxruntime {machine['onnxruntime']}"
    )


def machine_facts() -> dict[str, Any]:
    import onnxruntime

    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def profile_table(result: dict[str, Any], top: int, title: str) -> Table:
    """ORT's operators beside torch's for one mode, top `top` of each by time per step."""
    t = Table(title=title)
    for col in ("ORT operator", "ms/step", "calls", "torch operator", "ms/step ", "calls "):
        t.add_column(col, justify="left" if "operator" in col else "right")
    ort, torch_ = result.get("ort_ops", []), result.get("torch_ops", [])

    def cells(rows: list[dict[str, Any]], i: int) -> list[str]:
        if i >= len(rows):
            return ["", "", ""]
        r = rows[i]
        op = f"{r['op']} [dim](ORT ran inside)[/dim]" if r.get("ort_run") else r["op"]
        return [op, f"{r['ms_per_step']:.2f}", f"{r['calls_per_step']:g}"]

    for i in range(min(top, max(len(ort), len(torch_)))):
        t.add_row(*cells(ort, i), *cells(torch_, i))
    t.add_row(
        "[bold]all ORT kernels[/bold]" if ort else "(no ORT session)",
        f"{total_ms(ort):.2f}" if ort else "",
        "",
        "[bold]all torch operators (self, ORT's runs left out)[/bold]",
        f"{total_ms(torch_):.2f}",
        "",
    )
    return t


def profile_modes(args: argparse.Namespace, modes: list[str], settings: list[str], console: Console) -> None:
    """`--profile`: one profiled measurement per (setting, mode), printed side by side, full lists in the JSON."""
    results = []
    for setting in settings:
        overrides = [f"+recipe={args.recipe}", *args.overrides, *([setting] if setting else [])]
        for mode in modes:
            console.print(f"[dim]{setting or 'recipe defaults'}: profiling {mode}[/dim]")
            result = run_worker(mode, args.steps, args.warmup, overrides, profile=True)
            results.append(result | {"setting": setting or "-"})
            if "error" in result:
                console.print(f"{mode}: failed: {result['error']}")
                continue
            title = (
                f"{setting + ': ' if setting else ''}{mode} (executed by {result['executed_by']}), "
                f"{result['step_ms']:.1f} ms/step under the profilers, {args.steps} steps"
            )
            console.print(profile_table(result, args.top, title))
    out = args.out or Path("outputs") / "bench" / f"profile-{datetime.now():%Y-%m-%d_%H-%M-%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args) | {"out": str(out)}, "machine": machine_facts(), "profiles": results}, indent=2)
    )
    console.print(f"written: {out}")


if __name__ == "__main__":
    main()
