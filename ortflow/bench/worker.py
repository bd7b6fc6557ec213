"""One benchmark measurement in its own process (a process per measurement gives each mode its own peak memory
and a cold first step):

    python -m ortflow.bench.worker --result FILE --budget SECONDS [--steps N] [--profile] MODE [OVERRIDES]

The result (or the error) is written as JSON to FILE. Everything the process prints (ONNX Runtime's native log
lines, torch's notices and warnings, ortflow's own log records) goes to its stdout and stderr, which ortflow-bench
points at the bench's log file.
"""

import argparse
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from ortflow.api import register_configs
from ortflow.bench.measure import measure, profile
from ortflow.bench.plan import known_modes
from ortflow.bench.processes import PARENT_ENV
from ortflow.run.launch import end_with_parent


def _end_with_parent() -> None:
    """Linux: have the kernel send SIGTERM when the bench that started this process dies (even by SIGKILL), so no
    measurement runs on orphaned; if it is gone already, end now (a bench killed while this process imported)."""
    parent = os.environ.get(PARENT_ENV)
    if parent is not None and sys.platform.startswith("linux") and not end_with_parent(int(parent)):
        sys.exit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ortflow.bench.worker")
    p.add_argument("--result", type=Path, required=True, help="where the result (or the error) is written, as JSON")
    p.add_argument("--budget", type=float, default=10.0, help="seconds of timed steps")
    p.add_argument("--min-steps", type=int, default=2, help="timed steps per pass at least")
    p.add_argument("--steps", type=int, default=None, help="timed steps per pass (instead of the budget)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first one")
    p.add_argument("--profile", action="store_true", help="operators per step instead of timing")
    p.add_argument("mode")
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _end_with_parent()
    # This process's stderr is the bench's log: ortflow's records (ORT's native lines among them) and other
    # libraries' warnings go there, each with its origin.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.captureWarnings(True)
    if args.mode.partition(":")[0] not in (known := known_modes(args.overrides)):
        raise SystemExit(f"mode must be one of {known}, optionally followed by :overrides")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stopped: scratch removed
    register_configs()
    torch.manual_seed(0)
    task = profile if args.profile else measure
    with tempfile.TemporaryDirectory(prefix="ortflow-bench-") as scratch:
        try:
            result = task(args, Path(scratch))
        except Exception as err:  # a failed measurement is a row of the report, not a crash of the bench
            traceback.print_exc()
            result = {"mode": args.mode, "error": f"{type(err).__name__}: {err}".strip()[:2000]}
        gc.collect()  # engines (and their ORT sessions) end before their files go
    partial = args.result.with_name(args.result.name + ".partial")
    partial.write_text(json.dumps(result))
    partial.replace(args.result)  # whole or absent, whenever this process is killed
    if "error" in result:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
