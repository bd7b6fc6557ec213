"""The bench's JSON file: rewritten whole after every measurement, read back by --resume (which continues only a
bench of the same arguments, machine and software versions), and the machine it was measured on."""

import argparse
import json
import os
import platform
import signal
import tempfile
from pathlib import Path
from typing import Any

import torch

from ortflow import machine

FORMAT = 1  # the JSON file's layout, for --resume


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def resumed_args(given: dict[str, Any], record: dict[str, Any], path: Path) -> argparse.Namespace:
    """The arguments of the bench in `record` (read from `path`). The options `given` beside --resume (those on
    the command line, none defaulted) must be the same as the bench's: a bench continued with others would mix two
    benchmarks in one table."""
    saved = record["args"]
    given = {k: v for k, v in given.items() if k != "resume"}
    if "out" in given and Path(given["out"]).resolve() == path.resolve():
        given.pop("out")
    differ = {k: v for k, v in given.items() if jsonable(v) != saved.get(k)}
    if differ:

        def show(key: str, value: Any) -> str:
            if key == "overrides":
                return "overrides " + (" ".join(value) or "(none)")
            return f"--{key.replace('_', '-')} {' '.join(value) if isinstance(value, list) else value}"

        raise SystemExit(
            f"ortflow-bench: error: --resume {path}: "
            + "; ".join(f"{show(k, v)} differs from the bench's {show(k, saved.get(k))}" for k, v in differ.items())
            + ". A resumed bench runs with the arguments it started with (they are in the file): leave these out, "
            "or start a new bench without --resume."
        )
    args = argparse.Namespace(**{"workload": None, **saved, "out": path, "resume": path})  # files before --workload
    args.sweep, args.overrides = list(args.sweep), list(args.overrides)
    return args


def read_record(path: Path) -> dict[str, Any]:
    """A bench's JSON file, for --resume.

    Raises:
        SystemExit: the file is missing, is not a bench's JSON, or is from another machine or software version."""
    try:
        record = json.loads(path.read_text())
    except OSError as err:
        raise SystemExit(f"ortflow-bench: error: --resume {path}: cannot read it ({err.strerror}).") from None
    except ValueError as err:
        raise SystemExit(f"ortflow-bench: error: --resume {path}: not JSON ({err}).") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or "args" not in record:
        raise SystemExit(
            f"ortflow-bench: error: --resume {path}: not a file ortflow-bench can continue (it has no "
            f"format {FORMAT} record of its arguments); start a new bench."
        )
    here = machine_facts()
    changed = [k for k in ("cpu", "torch", "onnxruntime") if record.get("machine", {}).get(k) != here[k]]
    if changed:
        then = ", ".join(f"{k} {record.get('machine', {}).get(k)}" for k in changed)
        raise SystemExit(
            f"ortflow-bench: error: --resume {path}: it was measured with {then}; here it is "
            f"{', '.join(f'{k} {here[k]}' for k in changed)}. Numbers from both would not compare: start a new bench."
        )
    return record


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Replace `path` by `record` in one step (a temporary file renamed over it): a bench killed at any moment
    leaves the previous complete file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # stopping waits for the rename
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
            json.dump(record, tmp, indent=2)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp.name, path)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def machine_facts() -> dict[str, Any]:
    import onnxruntime

    return {
        **machine.describe(measure_bf16=True),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def describe_machine(facts: dict[str, Any]) -> str:
    flags = [f for f in facts.get("flags", []) if f.startswith(("avx512", "amx", "bf16"))]
    bf16 = f", bf16 matmul {facts['bf16_matmul_speedup']:.2f}x fp32" if "bf16_matmul_speedup" in facts else ""
    return (
        f"{facts['cpu']} ({facts['cpu_count']} cores{', ' + ' '.join(flags) if flags else ''}{bf16}), "
        f"torch {facts['torch']}, onnxruntime {facts['onnxruntime']}"
    )
