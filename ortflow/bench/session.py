"""One bench from its arguments to its table: the plan's measurements not done yet, one process each, the JSON file
rewritten after each; a bench stopped by a signal keeps what it finished for --resume."""

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from ortflow.bench.categories import by_kind
from ortflow.bench.peak import bf16_matmul_peak_gflops, matmul_peak_gflops, peaks_text
from ortflow.bench.plan import check_configs, plan
from ortflow.bench.processes import Stopped, run_worker, stop_on_signals
from ortflow.bench.progress import Reporter
from ortflow.bench.records import (
    FORMAT,
    describe_machine,
    jsonable,
    machine_facts,
    read_record,
    resumed_args,
    write_record,
)
from ortflow.bench.summary import summarize
from ortflow.bench.tables import conversions_line, kinds_table, profile_table, short, table
from ortflow.bench.workloads import describe
from ortflow.config import BF16
from ortflow.report import terminal
from ortflow.report.plots import plot_scaling


def run(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """The bench of `args` (with --resume, of the file's arguments; `given` are the options on the command line,
    none defaulted, which must agree with them), its JSON file and log under outputs/bench unless --out says."""
    stamp = f"{datetime.now():%Y-%m-%d_%H-%M-%S}"
    out = args.resume or args.out or Path("outputs") / "bench" / f"{'profile-' if args.profile else ''}{stamp}.json"
    console = Console(width=None if sys.stdout.isatty() else 140, highlight=False, soft_wrap=True)  # paths whole
    # This process's log records and other libraries' notices go to the log beside the JSON (the measurement processes
    # write their output there too), not to the terminal.
    with terminal.job_logging(out.with_suffix(".log")):
        terminal.quiet_import("torch.utils.cpp_extension")  # its CUDA_HOME notice; `import onnxruntime` imports it
        record = None
        if args.resume:
            record = read_record(args.resume)
            args = resumed_args(given, record, args.resume)
        args.out = out
        check_configs(args)
        run_bench(args, record, console)
    console.print(f"written: {out}")


def run_bench(args: argparse.Namespace, record: dict[str, Any] | None, console: Console) -> None:
    """Every measurement of the plan not in `record` yet (a new bench: None), the JSON file rewritten after each;
    then the table (or the profiles) and, with --sweep, the PNG.

    Raises:
        SystemExit: stopped by SIGTERM or SIGINT (128 + the signal), after ending the running measurement."""
    measurements, log = plan(args), args.out.with_suffix(".log")
    if record is None:
        record = {"format": FORMAT, "args": jsonable(vars(args)), "machine": machine_facts(), "complete": False}
        record["planned"] = len(measurements)
    runs: list[dict[str, Any]] = record.setdefault("profiles" if args.profile else "runs", [])
    finished = {(r["setting"], r["mode"], r["repeat"]) for r in runs}
    todo = [m for m in measurements if m.key() not in finished]
    if args.resume:
        record["resumed"] = record.get("resumed", 0) + 1
        console.print(f"resuming {args.out}: {len(runs)} of {len(measurements)} measurements done, {len(todo)} to run")
    if not args.profile:
        record.setdefault("matmul_peaks_gflops", matmul_peak_gflops())
        console.print(f"fp32 matmul peak: {peaks_text(record['matmul_peaks_gflops'])}")
        if args.precision and BF16 in args.precision.split(","):
            record.setdefault("bf16_matmul_peak_gflops", bf16_matmul_peak_gflops())
            console.print(f"bf16 matmul peak: torch {record['bf16_matmul_peak_gflops']:.0f} GFLOP/s")
    if any(m.mode.startswith("ortmodule") for m in todo):
        from ortflow.accel.compat.extensions import ensure_built

        ensure_built()  # the one-time build is not part of any measurement
    write_record(args.out, record)
    console.print(f"results: {args.out} (rewritten after each measurement), log: {log}")
    reporter = Reporter(console, todo, runs, log)
    try:
        with stop_on_signals():
            for m in todo:
                reporter.start(m)
                start = time.monotonic()
                run = run_worker(args, m, log)
                run |= {"setting": m.setting, "mode": m.mode, "repeat": m.repeat, "index": m.index}
                run["wall_s"] = time.monotonic() - start
                runs.append(run)
                if not args.profile:
                    peak = max(record["matmul_peaks_gflops"].values())
                    record["rows"] = summarize(runs, peak, record.get("bf16_matmul_peak_gflops"))
                write_record(args.out, record)
                reporter.end(m, run)
    except Stopped as stopped:
        reporter.close()
        console.print(
            f"stopped ({stopped}): {len(runs)} of {len(measurements)} measurements are in {args.out}; "
            f"continue with: ortflow-bench --resume {args.out}"
        )
        raise SystemExit(128 + stopped.signum) from None
    reporter.close()
    if args.profile:
        finish_profile(args, record, console)
    else:
        finish(args, record, console)
    record["complete"] = True
    write_record(args.out, record)


def finish(args: argparse.Namespace, record: dict[str, Any], console: Console) -> None:
    """The table (and with --sweep, the PNG) from every measurement, MFU against the best matmul peak measured."""
    after = matmul_peak_gflops()
    peaks = {k: max(v, after[k]) for k, v in record["matmul_peaks_gflops"].items()}
    peak = max(peaks.values())
    console.print(
        f"fp32 matmul peak, best of before and after the runs: {peaks_text(peaks)}; MFU is against {peak:.0f}"
    )
    if "bf16_matmul_peak_gflops" in record:
        record["bf16_matmul_peak_gflops"] = max(record["bf16_matmul_peak_gflops"], bf16_matmul_peak_gflops())
        console.print(f"bf16 matmul peak, best of before and after: torch {record['bf16_matmul_peak_gflops']:.0f}")
    rows = summarize(record["runs"], peak, record.get("bf16_matmul_peak_gflops"))
    record |= {"matmul_peaks_gflops": peaks, "matmul_peak_gflops": peak, "rows": rows}
    machine = record["machine"]
    how = f"{args.steps} steps" if args.steps else f"{args.budget:g} s of steps"
    console.print(
        table(record["rows"], f"ortflow-bench: {describe(args.recipe, args.workload)}, {how} x {args.repeats} repeats")
    )
    console.print(f"machine: {describe_machine(machine)}")
    if args.sweep:
        title = f"ortflow-bench {describe(args.recipe, args.workload)}: {describe_machine(machine)}"
        png = plot_scaling(record["rows"], args.out.with_suffix(".png"), title)
        record["png"] = str(png)
        console.print(f"written: {png}")


def finish_profile(args: argparse.Namespace, record: dict[str, Any], console: Console) -> None:
    for result in record["profiles"]:
        setting = "" if result["setting"] == "-" else result["setting"] + ": "
        if "error" in result:
            console.print(f"{setting}{result['mode']}: failed: {short(result['error'])}")
            continue
        title = (
            f"{setting}{result['mode']} (executed by {result['executed_by']}), "
            f"{result['step_ms']:.1f} ms/step under the profilers, {result['steps']} steps"
        )
        console.print(profile_table(result, args.top, title))
        if "conversions" in result:
            console.print(conversions_line(result, record["profiles"]))
        result["by_kind"] = by_kind(result)
    if any("by_kind" in p for p in record["profiles"]):
        console.print(kinds_table(record["profiles"], "ms per step by kind of work (share of the profiled step)"))
