"""trainer.allocator: glibc malloc's thresholds held steady, checked by where a 4 MiB block comes from (mmap or the
heap), in a fresh process for each setting (the first setting stays for a process's life)."""

import json
import os
import subprocess
import sys

import pytest

from ortflow import allocator

PROBE = """
import ctypes, json, sys
from ortflow import allocator

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
applied = allocator.apply(sys.argv[1])
before = libc.mallinfo2().hblkhd
block = libc.malloc(4 << 20)
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(json.dumps({"applied": applied, "mapped": mapped}))
"""


def _probe(setting: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True, env=env, timeout=60
    )
    return json.loads(done.stdout)


pytestmark = pytest.mark.skipif(allocator._glibc() is None, reason="glibc's malloc only")


def test_steady_takes_large_blocks_from_the_heap_and_system_maps_them():
    steady, system = _probe("steady"), _probe("system")
    assert steady["applied"] == {
        "MALLOC_MMAP_THRESHOLD_": str(allocator.MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": str(allocator.TRIM_THRESHOLD),
        "allocator": "steady",
    }
    assert steady["mapped"] == 0
    assert system["applied"] == {"allocator": "system"} and system["mapped"] >= 4 << 20


def test_a_threshold_from_the_environment_is_kept():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    probe = _probe("steady", env)
    assert probe["applied"]["MALLOC_MMAP_THRESHOLD_"] == "131072 (from the environment)"
    assert probe["mapped"] >= 4 << 20  # glibc took the user's threshold, and ortflow did not override it
