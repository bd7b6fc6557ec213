"""What this CPU is and what it runs fast: its model, the flags that decide bf16's speed, and bf16's speed measured.

bf16 is fast only on CPUs with bf16 units (x86 `avx512_bf16` or `amx_bf16`, Arm `bf16`); elsewhere torch emulates it
and a bf16 matmul is slower than an fp32 one. `trainer.precision=auto` picks bf16-mixed only where the units are; a
bf16-mixed run on a CPU without them is warned once, with the speed measured here (`bf16_matmul_speedup`).
"""

import functools
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from ortflow.config import AUTO, BF16, FP32

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (AVX-512 BF16, AMX), Arm (FEAT_BF16)
# The flags recorded with a run or a benchmark: those that decide which kernels torch and ORT run.
FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", *BF16_FLAGS, "amx_tile", "amx_int8", "asimd")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (Linux; elsewhere the platform's processor name)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return model, frozenset(flags)


def cpu_model() -> str:
    return _cpuinfo()[0]


def bf16_units() -> bool:
    """Whether the CPU computes bf16 in hardware (its flags say so)."""
    return any(flag in _cpuinfo()[1] for flag in BF16_FLAGS)


@functools.cache
def bf16_matmul_speedup(size: int = 512, repeats: int = 8) -> float:
    """torch's bf16 matmul throughput over its fp32 one on this CPU (best of `repeats`, after a warm-up; ~0.1 s)."""

    def best(dtype: torch.dtype) -> float:
        a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
        torch.mm(a, a)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, a)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(torch.float32) / best(torch.bfloat16)


def describe(measure_bf16: bool = False) -> dict[str, Any]:
    """The CPU as run.json and the benchmark record it."""
    model, flags = _cpuinfo()
    facts: dict[str, Any] = {
        "cpu": model,
        "flags": [flag for flag in FLAGS_THAT_MATTER if flag in flags],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "bf16_units": bf16_units(),
    }
    if measure_bf16:
        facts["bf16_matmul_speedup"] = round(bf16_matmul_speedup(), 2)
    return facts


def resolve_precision(precision: str) -> str:
    """trainer.precision with `auto` resolved: bf16-mixed where the CPU has bf16 units, fp32 elsewhere."""
    if precision == AUTO:
        return BF16 if bf16_units() else FP32
    return precision


def emulation_warning(precision: str) -> str | None:
    """For a bf16-mixed run on a CPU whose bf16 is emulated (no bf16 units, or a bf16 matmul measured no faster than
    fp32): one line saying so, with the measured speed. None otherwise."""
    if precision != BF16:
        return None
    speedup = bf16_matmul_speedup()
    if bf16_units() and speedup > 1.0:
        return None
    units = "has bf16 units" if bf16_units() else f"has no bf16 units ({' or '.join(BF16_FLAGS[:2])})"
    return (
        f"trainer.precision=bf16-mixed: this CPU ({cpu_model()}) {units}; torch emulates bf16 here, and a bf16 "
        f"matmul measured {speedup:.2f}x the speed of fp32. It trains correctly but likely slower than "
        "trainer.precision=fp32 (trainer.precision=auto picks fp32 on such a CPU)."
    )
