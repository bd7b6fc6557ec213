"""Per-operator time per training step from ORT's own profiler and torch.profiler (`ortflow-bench --profile`).

ORT's profile (SessionOptions.enable_profiling, one JSON trace per session, written when the session ends) times
every graph node run; torch.profiler times every aten operator torch runs (for eager, all the work; under the ORT
modes, what torch does around ORT: the optimizer step under ORTModule, batch glue) and ortflow's own ranges (e.g.
`ortflow::draw_dropout_masks`). Both are reduced to one list per source: operator, milliseconds per step (self
time), calls per step. In torch's list, the ranges inside which ORT ran a graph are marked (`ort_run`): their self
time is ORT's, so they are left out of torch's total.
"""

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

OpRow = dict[str, Any]  # {"op": str, "ms_per_step": float, "calls_per_step": float}


def _rows(totals_us: dict[str, float], calls: dict[str, int], steps: int) -> list[OpRow]:
    rows = [
        {"op": op, "ms_per_step": us / steps / 1000, "calls_per_step": calls[op] / steps}
        for op, us in totals_us.items()
    ]
    return sorted(rows, key=lambda r: r["ms_per_step"], reverse=True)


def ort_ops(profile_dir: Path, skip_runs: int, steps: int) -> list[OpRow]:
    """ORT's kernel time per step by operator type, from every session profile in `profile_dir`.

    Each graph node runs once per step; its first `skip_runs` runs (the first step and the warm-up) are left out,
    so the rest are the `steps` profiled ones."""
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for path in sorted(profile_dir.glob("*.json")):
        runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for event in json.loads(path.read_text()):
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                runs[event["name"]].append(event)
        for events in runs.values():
            for event in sorted(events, key=lambda e: e["ts"])[skip_runs:]:
                op = event.get("args", {}).get("op_name", "?")
                totals[op] += event["dur"]
                calls[op] += 1
    return _rows(totals, calls, steps)


# torch.profiler ranges whose self time is ONNX Runtime running a graph (its kernels are in ORT's own list):
# ORTModule's autograd Function, and the ranges the artifacts engine marks its ORT calls with.
ORT_RUN_RANGES = ("_ORTModuleFunction", "ortflow::ort_")


def torch_ops(profiler: torch.profiler.profile, steps: int) -> list[OpRow]:
    """torch's self CPU time per step by operator, from a finished torch.profiler run over `steps` steps. Rows for
    a range inside which ORT ran a graph have `ort_run: True`."""
    totals = {e.key: e.self_cpu_time_total for e in profiler.key_averages() if e.self_cpu_time_total > 0}
    calls = {e.key: e.count for e in profiler.key_averages()}
    return [r | {"ort_run": r["op"].startswith(ORT_RUN_RANGES)} for r in _rows(totals, calls, steps)]


def total_ms(rows: list[OpRow]) -> float:
    """The rows' time per step, leaving out ranges in which ORT ran (their time is ORT's kernels and overhead)."""
    return sum(r["ms_per_step"] for r in rows if not r.get("ort_run"))
