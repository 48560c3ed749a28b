"""Process memory: large step buffers kept mapped between steps, freed pages handed back to the OS when idle (glibc),
and zero tensors whose pages are committed only when written (the KV cache)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import resource
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) whose memory is committed page by page on first write.

    An anonymous mapping reads as zeros and the OS backs a page only when it is written, so a 2 GiB KV cache
    costs neither the ~1-5 s of zero-filling every page at start-up nor resident memory for blocks never used
    (torch.zeros writes them all). The tensor keeps the mapping alive; it is page-aligned.
    """
    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows: no anonymous-mapping flags)
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def _proc_kib_field(path: str, key: str) -> int | None:
    """A "key: N kB" line of a Linux /proc file, in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """The process's resident set now (Linux /proc), else its peak (getrusage)."""
    rss = _proc_kib_field("/proc/self/status", "VmRSS:")
    if rss is not None:
        return rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def available_memory_bytes() -> int:
    """Memory a new allocation can get: Linux's MemAvailable (free pages plus the page cache it can drop: a machine
    that has read a large model file has little *free* memory), else free pages, else 8 GiB."""
    available = _proc_kib_field("/proc/meminfo", "MemAvailable:")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * 2**30


_MADV_DONTNEED = 4  # Linux


def file_mapped(t: torch.Tensor) -> bool:
    """Whether the tensor's bytes lie in one mapping of a file (Linux /proc/self/maps: a safetensors tensor, a GGUF
    file's view): what `release_mapped_pages` may drop (a private one: when nothing wrote to it). False elsewhere."""
    if t.numel() == 0 or not sys.platform.startswith("linux"):
        return False
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                if lo <= start and end <= hi:
                    # a file's mapping: an inode and a path (not [heap], [stack] or an anonymous region)
                    return len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/")
    except (OSError, ValueError, IndexError):
        pass
    return False


def release_mapped_pages(t: torch.Tensor) -> bool:
    """Drop the process's pages of a tensor that views a read-only file mapping (madvise MADV_DONTNEED on the
    whole pages inside it): they stay in the page cache and the next read maps them again, but they leave the
    resident set. Only for such tensors (anonymous memory would read back as zeros). False where unsupported."""
    madvise = _libc_function("madvise") if sys.platform.startswith("linux") else None
    if madvise is None or t.numel() == 0:
        return False
    page = mmap.PAGESIZE
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0
