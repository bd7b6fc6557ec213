"""Per-operator time per training step from ORT's own profiler and torch.profiler (`ortflow-bench --profile`).

ORT's profile (SessionOptions.enable_profiling, one JSON trace per session, written when the session ends) times
every graph node run; torch.profiler times every aten operator torch runs (for eager, all the work; under the ORT
modes, what torch does around ORT: the optimizer step under ORTModule, batch glue) and ortflow's own ranges (e.g.
`ortflow::draw_dropout_masks`). Both are reduced to one list per source: operator, milliseconds per step (self
time), calls per step. In torch's list, the ranges inside which ORT ran a graph are marked (`ort_run`): their self
time is ORT's, so they are left out of torch's total.
"""

import json
import math
from collections import defaultdict
from collections.abc import Iterator
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


def _node_runs(profile_dir: Path, skip_runs: int) -> Iterator[dict[str, Any]]:
    """Every graph node's runs in every session profile in `profile_dir`, its first `skip_runs` runs left out (the
    first step and the warm-up): each node runs once per step, so the rest are the profiled steps'."""
    for path in sorted(profile_dir.glob("*.json")):
        runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for event in json.loads(path.read_text()):
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                runs[event["name"]].append(event)
        for events in runs.values():
            yield from sorted(events, key=lambda e: e["ts"])[skip_runs:]


def ort_ops(profile_dir: Path, skip_runs: int, steps: int) -> list[OpRow]:
    """ORT's kernel time per step by operator type, from every session profile in `profile_dir` over the `steps`
    profiled steps (_node_runs)."""
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in _node_runs(profile_dir, skip_runs):
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


# ---------------------------------------------------------------------------------------------- dtype conversions
# Bytes per element of the floating-point dtypes as each profiler names them (torch.profiler's input dtypes, ORT's
# type names in a node's input_type_shape / output_type_shape). A conversion has a 16-bit float on one side (what
# mixed precision adds); float64<->float32 scalars (an optimizer's step count, a learning rate) are not counted.
_TORCH_FLOATS = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2}
_ORT_FLOATS = {"float": 4, "double": 8, "bfloat16": 2, "float16": 2}


def _is_conversion(source: str | None, target: str | None, floats: dict[str, int]) -> bool:
    return source != target and source in floats and target in floats and 2 in (floats[source], floats[target])


Conversions = dict[str, float]  # {"count": per step, "mb": per step, "ms": per step}


def _conversions(count: int, nbytes: float, us: float, steps: int) -> Conversions:
    return {"count": count / steps, "mb": nbytes / steps / 1e6, "ms": us / steps / 1000}


def torch_conversions(profiler: torch.profiler.profile, steps: int) -> Conversions:
    """torch's dtype conversions per step: every `aten::copy_` between a 16-bit float and another float (what
    `.to(dtype)`, autocast's casts and a kernel's own casts run), counted wherever it ran (eager's step, torch-kernel
    nodes inside ORT's graphs, ortflow's own torch ops); copies that keep the dtype are not conversions. Needs a
    profile taken with record_shapes=True. MB: bytes read plus bytes written."""
    count, nbytes, us = 0, 0.0, 0.0
    for event in profiler.events():
        if event.name != "aten::copy_":
            continue
        dtypes, shapes = list(getattr(event, "input_dtypes", []) or []), list(event.input_shapes or [])
        if len(dtypes) < 2 or len(shapes) < 1 or not _is_conversion(dtypes[0], dtypes[1], _TORCH_FLOATS):
            continue
        count += 1
        nbytes += math.prod(shapes[0]) * (_TORCH_FLOATS[dtypes[0]] + _TORCH_FLOATS[dtypes[1]])
        us += event.self_cpu_time_total
    return _conversions(count, nbytes, us, steps)


def _type_and_size(spec: list[dict[str, list[int]]]) -> tuple[str | None, int]:
    if not spec:
        return None, 0
    ((name, shape),) = spec[0].items()
    return name, math.prod(shape)


def ort_conversions(profile_dir: Path, skip_runs: int, steps: int) -> Conversions:
    """ORT's dtype conversions per step: its Cast nodes between a 16-bit float and another float, over the profiled
    runs (_node_runs, as in ort_ops)."""
    count, nbytes, us = 0, 0.0, 0.0
    for event in _node_runs(profile_dir, skip_runs):
        args = event.get("args", {})
        if args.get("op_name") != "Cast":
            continue
        source, size = _type_and_size(args.get("input_type_shape", []))
        target, _ = _type_and_size(args.get("output_type_shape", []))
        if not _is_conversion(source, target, _ORT_FLOATS):
            continue
        count += 1
        nbytes += size * (_ORT_FLOATS[source] + _ORT_FLOATS[target])
        us += event["dur"]
    return _conversions(count, nbytes, us, steps)


def total_conversions(*parts: Conversions) -> Conversions:
    return {key: sum(p[key] for p in parts) for key in ("count", "mb", "ms")}
