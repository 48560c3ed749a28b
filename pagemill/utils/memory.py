"""Handing freed heap memory back to the operating system (glibc keeps it in its arenas otherwise)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_memory() -> bool:
    """Return the process's free heap pages to the OS (glibc `malloc_trim(0)`); False where there is no such call.

    A serving process allocates and frees many short-lived buffers per request; glibc keeps the freed pages in its
    arenas, so RSS creeps up with the number of requests served even though nothing leaks. Trimming when the engine
    goes idle keeps RSS at what is in use, for a few milliseconds only while there is no work."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
