"""The heap: large step buffers kept mapped between steps, freed pages handed back to the OS when idle (glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or None where it cannot be loaded."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _libc_function(name: str):
    """A C library function, or None where there is none (not glibc: musl, macOS)."""
    return getattr(_libc(), name, None)


def release_free_memory() -> bool:
    """Return the process's free heap pages to the OS (glibc `malloc_trim(0)`); False where there is no such call.

    A serving process allocates and frees many short-lived buffers per request; glibc keeps the freed pages in its
    arenas, so RSS creeps up with the number of requests served even though nothing leaks. Trimming when the engine
    goes idle keeps RSS at what is in use, for a few milliseconds only while there is no work."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Step buffers up to this size come from the heap and stay mapped between steps.
STEP_BUFFER_MAX_BYTES = 1 << 30


@functools.cache
def keep_step_buffers_mapped() -> bool:
    """Serve large allocations from the heap and keep freed heap pages mapped (glibc `mallopt`); False where there
    is no such call or the user set glibc's own MALLOC_* variables.

    glibc maps every allocation above its mmap threshold (at most 32 MiB) afresh and unmaps it on free, so a tensor
    that size allocated each step (Gemma 3's 32 x 262,144 float32 logits: 33.5 MB) page-faults and zeroes all its
    pages every step: measured 9 ms on a 20 ms LM head. From the heap it is reused; `release_free_memory` still
    hands the pages back when the engine goes idle. The role vLLM's CPU guide gives to preloading tcmalloc."""
    if any(k.startswith("MALLOC_") for k in os.environ):
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, STEP_BUFFER_MAX_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                   STEP_BUFFER_MAX_BYTES))
