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
from ortflow.bench_worker import MODES


def matmul_peak_gflops(n: int = 1024, repeats: int = 20) -> float:
    """Best fp32 matmul throughput of torch on this machine (its default thread count), in GFLOP/s.

    Measured before and after the runs (main takes the higher): on a shared machine one short measurement can
    land in a slow moment."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_worker(mode: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ortflow.bench_worker", mode, str(steps), str(warmup), *overrides]
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
    p.add_argument("--sweep", default=None, help="KEY=V1,V2,...: repeat everything for each value (scaling)")
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
    settings = [""]
    if args.sweep:
        key, _, values = args.sweep.partition("=")
        settings = [f"{key}={v}" for v in values.split(",")]
    peak = matmul_peak_gflops()
    console.print(f"fp32 matmul peak (torch, {torch.get_num_threads()} threads): {peak:.0f} GFLOP/s")
    runs = []
    for setting in settings:
        overrides = [f"+recipe={args.recipe}", *args.overrides, *([setting] if setting else [])]
        for repeat in range(args.repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:  # rotate the order
                console.print(f"[dim]{setting or 'recipe defaults'}: {mode}, repeat {repeat + 1}/{args.repeats}[/dim]")
                runs.append({**run_worker(mode, args.steps, args.warmup, overrides), "setting": setting or "-"})
    peak = max(peak, matmul_peak_gflops())
    console.print(f"fp32 matmul peak, best of before and after the runs: {peak:.0f} GFLOP/s")
    rows = summarize(runs, peak)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    console.print(table(rows, f"ortflow-bench: +recipe={args.recipe}, {args.steps} steps x {args.repeats} repeats"))
    out = args.out or Path("outputs") / "bench" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args) | {"out": str(out)}, "machine": machine, "matmul_peak_gflops": peak, "rows": rows}
    out.write_text(json.dumps(report | {"runs": runs}, indent=2))
    console.print(f"written: {out}")


if __name__ == "__main__":
    main()
