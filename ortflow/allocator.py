"""`trainer.allocator`: glibc malloc's two thresholds held steady for the process that trains.

Why: glibc adjusts its mmap threshold as a program frees large blocks and returns the top of its heap to the system
whenever 128 KiB there are free. A training step allocates and frees the same activation-sized blocks every step, so
with the defaults the step is paid for in page faults, and how many depends on what ran before: the same eager step
of the vision recipe varied 1517-2129 samples/s between two measurements on one Zen 5, and the engines that mix
ORT's and torch's allocations (ORT's graphs with torch's convolution kernels inside) lost the most (artifacts 0.87x
eager there). With the mmap threshold fixed at 32 MiB and the trim threshold at 1 GiB (what glibc's
MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ environment variables set at start-up) every engine was faster and
steady, and ORT's were level with eager (docs/performance.md). The price is resident memory the process keeps
instead of returning: up to the trim threshold of freed heap, tens of MB in the recipes.

`steady` (the default) sets both with mallopt(3) in the training process (its DDP ranks, the benchmark's
measurements and auto's probes share it); `system` keeps glibc's own behaviour. A threshold the user gave in the
environment is kept. Other C libraries (macOS, musl) and a preloaded allocator (jemalloc, tcmalloc) are left alone.
"""

import ctypes
import ctypes.util
import functools
import os
from typing import Any

MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 1024 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_ENVIRONMENT = {_M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", _M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_"}
STEADY, SYSTEM = "steady", "system"

_applied: dict[str, str] = {}


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc and malloc is its own (not a preloaded allocator)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload or "tcmalloc" in preload or "mimalloc" in preload:
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    glibc = hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")  # only glibc has the first
    return libc if glibc else None


def apply(setting: Any) -> dict[str, str]:
    """Hold malloc's thresholds steady (`steady`) or leave them (`system`); return what the process runs with, for
    run.json's host record. Idempotent; the first call's setting stays for the life of the process (a later `system`
    cannot give glibc its dynamic threshold back)."""
    if _applied:
        return dict(_applied)
    setting = getattr(setting, "value", setting)  # trainer.allocator's enum, or its name
    libc = _glibc()
    if setting == SYSTEM or libc is None:
        _applied["allocator"] = SYSTEM if libc is not None else "not glibc malloc: left as it is"
        return dict(_applied)
    for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        given = os.environ.get(_ENVIRONMENT[param])
        if given is not None:
            _applied[_ENVIRONMENT[param]] = f"{given} (from the environment)"
            continue
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            _applied[_ENVIRONMENT[param]] = "refused by mallopt"
            continue
        _applied[_ENVIRONMENT[param]] = str(value)
    _applied["allocator"] = STEADY
    return dict(_applied)


def applied() -> dict[str, str]:
    """What `apply` set in this process ({} before it ran)."""
    return dict(_applied)
