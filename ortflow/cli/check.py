"""`ortflow-check [OVERRIDES]`: before choosing `accel=`, try every accel mode for a few steps on the model and data
the overrides describe, and print one table: whether each mode trains (or the one-line reason it does not), loss
parity against eager on the same batches and the same initial weights (dropout off), each parameter's step-1
gradient against eager's, a verdict against eager's own noise (ortflow/check/parity.py), the smallest errors the check
can see, step time, and the graph fixes ortflow applied.
Every row and eager's own noise run in the config's trainer.precision, or in each of `--precision fp32,bf16-mixed`.
With `--strict` the command exits with status 1 when a row differs, or does not train where eager does (it crashes, is
refused, runs partly outside its engine or reaches a non-finite loss), or cannot be judged (eager's own runs too
chaotic for the check to see a 1% step-1 gradient error: `--accept-unjudgeable` passes those): a CI gate no broken
engine passes.
The result also goes to a JSON file (`--out`, default outputs/check/<time>.json).
"""

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

from rich.console import Console

from ortflow import accel
from ortflow.check import parity
from ortflow.check.modes import check
from ortflow.check.table import table
from ortflow.config import BF16, FP32
from ortflow.errors import OrtflowError
from ortflow.paths import search_dirs
from ortflow.report import terminal


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ortflow-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="the same overrides as a training run (accel= is ignored)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per mode (default 5)")
    parser.add_argument(
        "--modes", help="comma-separated accel modes (default: all, the search path's engines among them)"
    )
    parser.add_argument(
        "--precision",
        help=f"comma-separated trainer.precision values to try every mode in ({FP32}, {BF16}; default: the config's)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a row differs or does not train where eager does"
    )
    parser.add_argument(
        "--accept-unjudgeable",
        action="store_true",
        help="with --strict, pass a row the check cannot judge (eager's own runs too chaotic to see a 1%% error)",
    )
    parser.add_argument("--out", type=Path, help="JSON file (default outputs/check/<time>.json)")
    args = parser.parse_args(argv)
    precisions = tuple(args.precision.split(",")) if args.precision else None
    if wrong := [p for p in precisions or () if p not in (FP32, BF16)]:
        parser.error(f"--precision: unknown precision(s) {wrong}; choose from {FP32},{BF16}")
    out = args.out or Path("outputs") / "check" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.json"
    overrides = [o for o in args.overrides if not o.startswith("accel=")]
    try:
        modes = args.modes.split(",") if args.modes else list(accel.engines(search_dirs(overrides)))
    except OrtflowError as err:
        print(f"ortflow-check: error: {err}", file=sys.stderr)
        sys.exit(2)
    # Other libraries' notices (torch's tracer and deprecation warnings, transformers, ONNX Runtime's native log
    # lines, the CUDA_HOME notice) go to a log file beside the JSON, as a training run's go to its ortflow.log.
    with terminal.job_logging(out.with_suffix(".log")):
        terminal.quiet_import("torch.utils.cpp_extension")
        try:
            with terminal.native_stderr("ortflow-check"):
                report = check(overrides, max(args.steps, 2), modes, precisions)
        except OrtflowError as err:
            print(f"ortflow-check: error: {err}", file=sys.stderr)
            sys.exit(2)
    Console(width=None if sys.stdout.isatty() else 200).print(table(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"log: {out.with_suffix('.log')}")
    print(f"written to {out}")
    if args.strict and (failed := parity.failures(report, args.accept_unjudgeable)):
        print(f"ortflow-check --strict: {len(failed)} failed: " + "; ".join(failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
