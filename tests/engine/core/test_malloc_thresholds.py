"""Large buffers kept in glibc's heap: a buffer of megabytes is no longer mapped on its own once
`keep_large_buffers_in_heap` ran, and users' own malloc settings are left alone. The
allocation checks run in a fresh interpreter each, since the setting is process-wide."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys

import pytest

from engine.core.malloc_thresholds import keep_large_buffers_in_heap

# mallinfo2 is glibc 2.33's.
_ON_GLIBC = (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
             and hasattr(ctypes.CDLL(None), "mallinfo2"))

# Prints whether the thresholds were set and how many bytes glibc had mapped on their own
# (mallinfo2's hblkhd) while a 4 MiB buffer lived.
_PROBE = """
import ctypes, json, sys
from engine.core.malloc_thresholds import keep_large_buffers_in_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
tuned = keep_large_buffers_in_heap() if sys.argv[1] == "tune" else False
before = mallinfo2().hblkhd
buffer = bytearray(4 * 1024 * 1024)
print(json.dumps({"tuned": tuned, "mapped_bytes": mallinfo2().hblkhd - before}))
"""


def _probe(mode: str) -> dict[str, object]:
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith("MALLOC_") and name != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True,
                            text=True, check=True, env=environ)
    return json.loads(result.stdout)


@pytest.mark.skipif(not _ON_GLIBC, reason="the thresholds are glibc's (mallinfo2: 2.33)")
def test_a_buffer_of_megabytes_comes_from_the_heap_once_the_thresholds_are_set() -> None:
    assert _probe("default") == {"tuned": False, "mapped_bytes": pytest.approx(4 << 20,
                                                                              rel=0.01)}
    assert _probe("tune") == {"tuned": True, "mapped_bytes": 0}


@pytest.mark.parametrize("environ", [
    {"MALLOC_MMAP_THRESHOLD_": "131072"},
    {"MALLOC_ARENA_MAX": "2"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
])
def test_users_malloc_settings_are_left_alone(environ: dict[str, str]) -> None:
    assert keep_large_buffers_in_heap(environ) is False


# Prints the resident MiB over its start of a fresh interpreter with the thresholds set, after
# a thread allocated 48 MiB in 4 KiB blocks and freed them, then after that thread called
# `release_free_heap`.
_RELEASE_PROBE = """
import json, os, threading
from engine.core.malloc_thresholds import keep_large_buffers_in_heap, release_free_heap

def rss_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

keep_large_buffers_in_heap()
figures = {}

def allocate_and_free():
    start_mib = rss_mib()
    blocks = [bytes(4096) for _ in range(12 * 1024)]
    figures["allocated"] = rss_mib() - start_mib
    del blocks
    figures["freed"] = rss_mib() - start_mib
    figures["released"] = release_free_heap()
    figures["after_release"] = rss_mib() - start_mib

thread = threading.Thread(target=allocate_and_free)
thread.start()
thread.join()
print(json.dumps(figures))
"""


@pytest.mark.skipif(not _ON_GLIBC, reason="the thresholds are glibc's (mallinfo2: 2.33)")
def test_released_heap_goes_back_to_the_kernel_from_a_thread() -> None:
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith("MALLOC_") and name != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", _RELEASE_PROBE], capture_output=True,
                            text=True, check=True, env=environ)
    figures = json.loads(result.stdout)
    assert figures["allocated"] > 40 and figures["released"] is True
    assert figures["after_release"] < 8, figures
