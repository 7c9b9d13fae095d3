"""Keeping large buffers in the C heap instead of mapping and unmapping each one.

glibc's malloc gives every allocation over its mmap threshold (128 KiB at start) pages of
their own, and returns free memory at the top of a heap to the kernel once it exceeds the
trim threshold. Its dynamic rule raises both thresholds as large blocks are freed, but two
of this project's processes still paid for it, measured on its 2-core machine
(`docs/decisions/0019-malloc-thresholds.md`):
- `serve`'s own process, receiving request bodies: each 256 KiB read of a 15 MB body was
  copied into fresh buffers (h11's receive buffer, uvicorn's, the joined body), each mapped,
  faulted in page by page and unmapped again: 19 ms of CPU for each body received, two
  thirds of it in the kernel, against 4.5 ms with both thresholds set here (either alone
  changed nothing);
- the engine core on the CPU, whose forward allocates its activations anew each step:
  `bench throughput` ran at 5,900-6,100 tokens/s, against 7,000-7,100 with them.

`keep_large_buffers_in_heap` sets the mmap threshold to 32 MiB (over the 16 MiB body limit;
the ceiling of glibc's own dynamic threshold on 64-bit, and of what older glibc accepts) and
the trim threshold to twice that, the ratio glibc's dynamic rule keeps. The cost is memory
kept for reuse: freed buffers of up to 32 MiB stay in the heap, and up to the trim threshold
of free memory stays at the top of each malloc arena (one per thread that allocated, up to
eight per core), besides the holes below live blocks that no setting returns. Measured: 30 MB
more resident after a run of 15 MB bodies in a bare server.

Only a process's owner may call it (`serve`'s main process, the engine core process): it
changes malloc for the whole process, for good. Users who tune malloc themselves (any
`MALLOC_*` variable, malloc tunables in `GLIBC_TUNABLES`, or another allocator preloaded with
`LD_PRELOAD`: jemalloc, tcmalloc, mimalloc) keep their setting.

The trim threshold has a cost in threads other than the main one: glibc returns the free top
of a thread's arena only from a `free()` that leaves it over the threshold, and a thread arena
grows in heaps of 64 MiB at most, so past 64 MiB its top is never returned, nor is it by
`malloc_trim`, which returns the free pages inside chunks and the main arena's top only. A
thread that frees a large transient allocation (the engine core's grammar compile thread,
after a compile it refused) calls `release_free_heap`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
# A block whose free() makes glibc look at its arena's top (it does from 64 KiB).
_TRIM_PROBE_BYTES = 128 * 1024
# Whether `keep_large_buffers_in_heap` set the thresholds in this process.
_thresholds_set = False


def keep_large_buffers_in_heap(environ: dict[str, str] | None = None) -> bool:
    """Sets glibc's mmap threshold to `MMAP_THRESHOLD_BYTES` and its trim threshold to
    `TRIM_THRESHOLD_BYTES` for this process; whether it did. False, and nothing changed,
    where malloc is not glibc's or `environ` (default: `os.environ`) already tunes it. Called
    once, early in the life of a process that serves."""
    environ = os.environ if environ is None else environ
    preloaded = environ.get("LD_PRELOAD", "")
    if (any(name.startswith("MALLOC_") for name in environ)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or any(allocator in preloaded for allocator in _OTHER_ALLOCATORS)):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    # Both or neither: the trim threshold alone made receiving a body slower (31 ms a body).
    # glibc accepts any trim threshold, so only the mmap threshold can be refused (by an
    # older glibc, over 32 MiB).
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return False
    global _thresholds_set
    _thresholds_set = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _thresholds_set


def release_free_heap() -> bool:
    """Hands the C heap's free memory back to the kernel: the free top of the calling
    thread's arena, then with glibc's `malloc_trim(0)` the free pages inside every arena and
    the main arena's top. Where `keep_large_buffers_in_heap` set the thresholds, the top of a
    thread's arena goes only by lowering the trim threshold to 0 for one `free()` of a block
    of this thread's, then setting it back (other threads that free meanwhile return their
    tops too). Takes milliseconds; whether any memory was returned (False where malloc is not
    glibc's). Called by a thread just after it freed a large transient allocation."""
    libc = _glibc()
    if libc is None:
        return False
    if _thresholds_set:
        libc.mallopt(_M_TRIM_THRESHOLD, 0)
        try:
            libc.free(libc.malloc(_TRIM_PROBE_BYTES))
        finally:
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    return bool(libc.malloc_trim(0))


def _glibc_mallopt() -> ctypes._CFuncPtr | None:
    """glibc's `mallopt` on a 64-bit Linux, or None (another C library, such as musl's or
    macOS's; a 32-bit glibc, whose largest mmap threshold is 512 KiB)."""
    libc = _glibc()
    return None if libc is None else libc.mallopt


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library with `mallopt`, `malloc`, `free` and `malloc_trim` typed, on a 64-bit
    Linux with glibc; None elsewhere."""
    if (platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
            or ctypes.sizeof(ctypes.c_void_p) != 8):
        return None
    try:
        libc = ctypes.CDLL(None)
        functions = (libc.mallopt, libc.malloc, libc.free, libc.malloc_trim)
    except (OSError, AttributeError):
        return None
    mallopt, malloc, free, malloc_trim = functions
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    malloc.argtypes, malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
    free.argtypes, free.restype = (ctypes.c_void_p,), None
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return libc
