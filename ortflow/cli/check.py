"""`ortflow-check [OVERRIDES]`: before choosing `accel=`, try every accel mode for a few steps on the model and data
the overrides describe, and print one table: whether each mode trains (or the one-line reason it does not), loss
parity against eager on the same batches and the same initial weights (dropout off), step-1 gradients against
eager's, a verdict against eager's own noise floor (ortflow/check/parity.py), step time, and the graph fixes
ortflow applied.
With `--precision fp32,bf16-mixed` every mode is tried in each precision, against eager in the same precision; a bf16
row's noise floor is eager bf16's own distance from eager fp32 (losses and step-1 gradients).
The result also goes to a JSON file (`--out`, default outputs/check/<time>.json).
"""

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

from rich.console import Console

from ortflow.check.modes import MODES, check
from ortflow.check.table import table
from ortflow.config import BF16, FP32
from ortflow.errors import OrtflowError
from ortflow.report import terminal


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ortflow-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="the same overrides as a training run (accel= is ignored)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per mode (default 5)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated accel modes (default: all)")
    parser.add_argument(
        "--precision",
        default=FP32,
        help=f"comma-separated trainer.precision values to try every mode in ({FP32}, {BF16}; default {FP32})",
    )
    parser.add_argument("--out", type=Path, help="JSON file (default outputs/check/<time>.json)")
    args = parser.parse_args(argv)
    precisions = tuple(args.precision.split(","))
    if wrong := [p for p in precisions if p not in (FP32, BF16)]:
        parser.error(f"--precision: unknown precision(s) {wrong}; choose from {FP32},{BF16}")
    out = args.out or Path("outputs") / "check" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.json"
    overrides = [o for o in args.overrides if not o.startswith("accel=")]
    # Other libraries' notices (torch's tracer and deprecation warnings, transformers, ONNX Runtime's native log
    # lines, the CUDA_HOME notice) go to a log file beside the JSON, as a training run's go to its ortflow.log.
    with terminal.job_logging(out.with_suffix(".log")):
        terminal.quiet_import("torch.utils.cpp_extension")
        try:
            with terminal.native_stderr("ortflow-check"):
                report = check(overrides, max(args.steps, 2), args.modes.split(","), precisions)
        except OrtflowError as err:
            print(f"ortflow-check: error: {err}", file=sys.stderr)
            sys.exit(2)
    Console(width=None if sys.stdout.isatty() else 200).print(table(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"log: {out.with_suffix('.log')}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
