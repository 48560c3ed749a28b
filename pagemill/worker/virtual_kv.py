"""vTensor-style virtual-contiguous KV memory on Linux: a memfd pool of physical chunks mapped into reserved ranges.

The physical pool is one memfd laid out like the paged cache, [layers, K/V, num_blocks, block_size, kv_heads,
head_dim]; a chunk is one block of one layer's K or V. Each input-batch row (request slot) owns, per layer and K/V,
a virtual range of max_model_len tokens, reserved read-only and uncommitted (reads of an unmapped part give zeros
from the kernel's zero page). As a request's block table grows, its blocks' chunks are mapped (`MAP_FIXED |
MAP_SHARED | MAP_POPULATE`) into its ranges, so its K and V are each one contiguous array in virtual memory while
prefix hits and forked siblings share physical chunks without copying. Chunks are mapped one chunk ahead, as vTensor
extends a tensor: the scheduler allocates the block of a request's next token one step early, and its chunks are
mapped by a background thread while the step before the one that writes it runs (ctypes releases the GIL in mmap),
so a decode that crosses into a new chunk finds it mapped and the step path maps nothing. Unmapping is lazy
(vTensor's lazy deallocation): a finished request's mappings stay until its slot is reused (only differing chunks
are remapped) or the engine goes idle or the mapping count nears `vm.max_map_count`.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

# Linux mmap flags (the same on x86-64 and arm64).
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_NORESERVE, _MAP_POPULATE = 0x4000, 0x8000
_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_FAILED = ctypes.c_void_p(-1).value
_MEMFD_NAME = "pagemill-kv"
# Mappings left to the rest of the process (torch, libraries, the pool view) under vm.max_map_count.
_MAP_COUNT_RESERVE = 8192


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    return libc


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def max_chunk_mappings() -> int:
    """Chunk mappings the process can hold: vm.max_map_count less a reserve for everything else."""
    return max(1024, _max_map_count() - _MAP_COUNT_RESERVE)


class _Runs(NamedTuple):
    """Chunk entries to map (slot, chunk, block each) in runs [starts[i], ends[i]) of consecutive blocks at
    consecutive chunks of one slot."""

    slots: np.ndarray
    cols: np.ndarray
    blocks: np.ndarray
    starts: np.ndarray
    ends: np.ndarray


def _runs(slots: np.ndarray, want: np.ndarray, mask: np.ndarray) -> _Runs | None:
    """The entries of `want` ([len(slots), width] blocks) where `mask` holds, as runs; None when there is none."""
    if not mask.any():
        return None
    rows, cols = np.nonzero(mask)
    blocks = want[rows, cols]
    # A run continues where the next entry is the same slot, the next chunk and the next block.
    brk = np.ones(len(rows), dtype=bool)
    brk[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1] + 1) | (blocks[1:] != blocks[:-1] + 1)
    starts = np.flatnonzero(brk)
    return _Runs(slots[rows], cols, blocks, starts, np.append(starts[1:], len(rows)))


class VirtualRanges:
    """Every request slot's reserved K/V ranges over a pool of physical chunks (one block of one layer's K or V),
    with the chunk -> range mappings; subclasses map and unmap (Linux mmap of a memfd; the CUDA driver's virtual
    memory API).

    Layout of the reservation, shared by both: [layers, K/V, 1 + num_slots, max_chunks, chunk], each range one
    layer's K (or V) of one slot, contiguous in tokens. Range 0 of each layer's K/V is the null range: its chunk 0
    maps the null block 0 for good, so padded tokens (block 0, slot 0) read and write there like the paged layout's."""

    map_ahead_in_background = True  # False: chunks allocated ahead are mapped on the step path (A/B)

    def _init_ranges(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, num_slots: int, max_model_len: int) -> None:
        """Shapes and counters (call before allocating): chunk and range sizes; `_init_tables` after reserving."""
        elem = torch.empty((), dtype=dtype).element_size()
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.num_slots = num_slots
        self.chunk_bytes = block_size * num_kv_heads * head_dim * elem
        self.max_chunks = -(-max_model_len // block_size)
        self.range_bytes = self.max_chunks * self.chunk_bytes  # one slot's K (or V) of one layer
        self.range_tokens = self.max_chunks * block_size
        self.pool_bytes = num_layers * 2 * num_blocks * self.chunk_bytes
        self.reserve_bytes = num_layers * 2 * (1 + num_slots) * self.range_bytes
        # Counters: map calls (each maps a run of chunks of one layer's K or V) and their seconds, on the step path
        # (before the forward) and in the background; chunks a step entered that were mapped ahead / had to be mapped.
        self.num_step_map_calls = self.num_background_map_calls = 0
        self.step_map_seconds = self.background_map_seconds = 0.0
        self.num_chunks_found_mapped = self.num_chunks_mapped_on_step = 0
        self.num_unmap_calls = 0
        self._mapper: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._max_vmas: int | None = None  # mappings allowed (None: no limit)

    def _init_tables(self) -> None:
        """The mapping table (after the reservation: a size the OS refuses is reported by name, not by numpy)."""
        # mapped[slot, j]: the block whose chunks are mapped at chunk j of the slot's ranges (-1: none).
        self.mapped = np.full((self.num_slots, self.max_chunks), -1, dtype=np.int64)
        self.live = np.zeros(self.num_slots, dtype=bool)

    # ---- addresses and views ----
    def _range_offset(self, slot: int, layer: int, kv: int, chunk: int) -> int:
        """Byte offset in the reservation of chunk `chunk` of `slot`'s `layer` K (kv=0) or V range; slot -1: the
        null range."""
        return (((layer * 2 + kv) * (1 + self.num_slots) + slot + 1) * self.max_chunks + chunk) * self.chunk_bytes

    def _view(self, flat: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> torch.Tensor:
        elem = flat.element_size()
        return flat.as_strided(shape, tuple(s // elem for s in strides), offset // elem)

    def range_view(self, layer: int, kv: int) -> torch.Tensor:
        """Every slot's K (kv=0) or V (kv=1) of `layer`: [num_slots, max_chunks * block_size, kv_heads, head_dim],
        each slot's tokens contiguous (no copy; only mapped tokens hold data)."""
        hd = self.num_kv_heads * self.head_dim
        elem = self._flat.element_size()
        return self._view(self._flat, (self.num_slots, self.range_tokens, self.num_kv_heads, self.head_dim),
                          (self.range_bytes, hd * elem, self.head_dim * elem, elem),
                          self._range_offset(0, layer, kv, 0))

    def layer_view(self, layer: int) -> torch.Tensor:
        """`layer`'s K and V ranges as a paged cache whose block b is range b (the null range, then slot b - 1):
        [2, 1 + num_slots, max_chunks * block_size, kv_heads, head_dim]; block table row = [slot + 1]."""
        hd = self.num_kv_heads * self.head_dim
        elem = self._flat.element_size()
        return self._view(self._flat, (2, 1 + self.num_slots, self.range_tokens, self.num_kv_heads, self.head_dim),
                          ((1 + self.num_slots) * self.range_bytes, self.range_bytes, hd * elem, self.head_dim * elem,
                           elem), self._range_offset(-1, layer, 0, 0))

    # ---- mappings (subclasses) ----
    def _map_run(self, slot: int, chunk: int, block: int, n: int) -> None:
        """Map blocks block..block+n-1 at chunks chunk..chunk+n-1 of every layer's K and V ranges of `slot`
        (slot -1: the null range)."""
        raise NotImplementedError

    def _unmap_run(self, slot: int, start: int, stop: int) -> None:
        """Put chunks start..stop-1 of every range of `slot` back to the reserved (unmapped) state."""
        raise NotImplementedError

    def _unmap_slot_chunks(self, slot: int, start: int, stop: int) -> None:
        self._unmap_run(slot, start, stop)
        self.num_unmap_calls += 2 * self.num_layers
        self.mapped[slot, start:stop] = -1

    def sync(self, slots: np.ndarray, block_table: np.ndarray, num_blocks: np.ndarray) -> None:
        """Make each slot's first num_blocks[slot] chunks map block_table[slot] now: only the entries that differ
        from what is mapped are (re)mapped, in runs of consecutive blocks at consecutive chunks."""
        n = num_blocks[slots]
        self.prepare_step(slots, block_table, n, n, n)

    def prepare_step(self, slots: np.ndarray, block_table: np.ndarray, first_new: np.ndarray, need: np.ndarray,
                     have: np.ndarray) -> None:
        """Before a step's forward (arrays aligned with `slots`): map chunks [0, need) of each slot, the ones the
        step reads, now; count the chunks the step enters, [first_new, need), that were already mapped (mapped
        ahead); and map [need, have), blocks the scheduler allocated ahead, in the background while the step runs
        (`map_ahead_in_background`; else now)."""
        self.wait()
        if len(slots) == 0:
            return
        self.live[slots] = True
        width = int(have.max())
        if width == 0:
            return
        want = block_table[slots, :width]
        cols = np.arange(width)[None, :]
        stale = want != self.mapped[slots, :width]
        now = cols < need[:, None]
        entered = now & (cols >= first_new[:, None])
        self.num_chunks_found_mapped += int(np.count_nonzero(entered & ~stale))
        self.num_chunks_mapped_on_step += int(np.count_nonzero(entered & stale))
        runs = _runs(slots, want, stale & now)
        if runs is not None:
            self._map_runs(runs, background=False)
        ahead = _runs(slots, want, stale & ~now & (cols < have[:, None]))
        if ahead is None:
            return
        if not self.map_ahead_in_background:
            self._map_runs(ahead, background=False)
            return
        if self._mapper is None:
            self._mapper = ThreadPoolExecutor(1, thread_name_prefix="pagemill-kv-map")
            weakref.finalize(self, self._mapper.shutdown, False)
        self._pending = self._mapper.submit(self._map_runs, ahead, True)

    def _map_runs(self, runs: _Runs, background: bool) -> None:
        """Map the runs (ctypes drops the GIL in each mmap call, so a background thread overlaps the forward)."""
        self._make_room(len(runs.cols))
        t = time.perf_counter()
        for s, e in zip(runs.starts.tolist(), runs.ends.tolist()):
            self._map_run(int(runs.slots[s]), int(runs.cols[s]), int(runs.blocks[s]), e - s)
        self.mapped[runs.slots, runs.cols] = runs.blocks
        calls, seconds = 2 * self.num_layers * len(runs.starts), time.perf_counter() - t
        if background:
            self.num_background_map_calls += calls
            self.background_map_seconds += seconds
        else:
            self.num_step_map_calls += calls
            self.step_map_seconds += seconds

    def wait(self) -> None:
        """Wait for the chunks being mapped in the background (re-raising its error) before `mapped` is read."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def num_map_calls(self) -> int:
        """mmap calls that mapped chunks (each covers a run of chunks of one layer's K or V), on either path."""
        self.wait()
        return self.num_step_map_calls + self.num_background_map_calls

    def release(self, slot: int) -> None:
        """The slot's request left (finished or preempted): its mappings, the chunk mapped ahead included, stay
        until the slot is reused or trimmed (lazy)."""
        self.wait()
        self.live[slot] = False

    def trim(self) -> None:
        """Unmap the chunks of every slot that holds no live request."""
        self.wait()
        self._trim()

    def _trim(self) -> None:
        for slot in np.flatnonzero(~self.live & (self.mapped >= 0).any(axis=1)).tolist():
            cols = np.flatnonzero(self.mapped[slot] >= 0)
            self._unmap_slot_chunks(slot, int(cols[0]), int(cols[-1]) + 1)

    def _make_room(self, num_new: int) -> None:
        """Trim idle slots' mappings when the mappings could near the limit (vm.max_map_count)."""
        if self._max_vmas is None:
            return
        if (int((self.mapped >= 0).sum()) + num_new) * 2 * self.num_layers > self._max_vmas:
            self._trim()

    # ---- accounting ----
    def num_mapped_chunks(self) -> int:
        """Chunk positions (of every layer's K and V ranges together) that map a physical chunk now."""
        self.wait()
        return int((self.mapped >= 0).sum())


class VirtualKVSpace(VirtualRanges):
    """The ranges in host memory: a memfd pool of physical chunks mapped (mmap MAP_FIXED) into a reservation."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, num_slots: int, max_model_len: int) -> None:
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            raise ValueError(f"kv_cache_layout='virtual' needs Linux (memfd_create and mmap MAP_FIXED); this is "
                             f"{sys.platform}: use kv_cache_layout='paged'.")
        self._init_ranges(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, num_slots,
                          max_model_len)
        self.page = mmap.PAGESIZE
        if self.chunk_bytes % self.page:
            elem = torch.empty((), dtype=dtype).element_size()
            tokens = self.page // math.gcd(self.page, num_kv_heads * head_dim * elem)
            raise ValueError(f"kv_cache_layout='virtual' maps whole {self.page}-byte pages: one layer's K for "
                             f"block_size={block_size} tokens is {self.chunk_bytes} bytes; use a block_size that "
                             f"is a multiple of {tokens}.")
        self._libc = _libc()
        # Physical pool: shmem pages are allocated on first write, like the paged layout's lazy anonymous mapping.
        fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.pool_bytes)
            pool_map = mmap.mmap(fd, self.pool_bytes, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # The reservation: read-only, uncommitted; chunk mappings replace parts of it (MAP_FIXED).
            reserved = mmap.mmap(-1, self.reserve_bytes,
                                 flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, prot=mmap.PROT_READ)
        except OSError as e:
            os.close(fd)
            raise ValueError(f"kv_cache_layout='virtual': the OS refused the KV mappings ({e}); use "
                             "kv_cache_layout='paged'.") from e
        self.fd = fd
        weakref.finalize(self, os.close, fd)  # the mappings outlive the descriptor; tensors keep them
        # The paged view of the pool (writes by slot mapping, copy-on-write and swap copies use it).
        self.pool = torch.frombuffer(pool_map, dtype=torch.uint8).view(dtype).view(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        with warnings.catch_warnings():  # read-only where unmapped; mapped chunks are writable
            warnings.simplefilter("ignore")
            # The tensors own the mmap objects: the reservation (with every chunk mapped into it) is unmapped when
            # the last view of it is gone.
            self._flat = torch.frombuffer(reserved, dtype=torch.uint8).view(dtype)
        self.base = self._flat.data_ptr()
        self._init_tables()
        self._max_vmas = max_chunk_mappings()
        self._map_run(-1, 0, 0, 1)  # the null range's chunk 0: the null block, for good

    def _mmap(self, addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        ptr = self._libc.mmap(addr, length, prot, flags, fd, offset)
        if ptr is None or ptr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}")
        return ptr

    def _map_run(self, slot: int, chunk: int, block: int, n: int) -> None:
        length = n * self.chunk_bytes
        for layer in range(self.num_layers):
            for kv in (0, 1):
                offset = ((layer * 2 + kv) * self.num_blocks + block) * self.chunk_bytes
                try:
                    # (the null range privately and unpopulated: padding's writes stay its own, it commits
                    # nothing until written, and its mapping never merges with a slot's in /proc/self/maps)
                    flags = _MAP_FIXED | (_MAP_PRIVATE if slot < 0 else _MAP_SHARED | _MAP_POPULATE)
                    self._mmap(self.base + self._range_offset(slot, layer, kv, chunk), length,
                               _PROT_READ | _PROT_WRITE, flags, self.fd, offset)
                except OSError as e:
                    raise RuntimeError(f"kv_cache_layout='virtual': mapping a KV chunk failed ({e}); a larger "
                                       "block_size needs fewer mappings (or raise vm.max_map_count).") from e

    def _unmap_run(self, slot: int, start: int, stop: int) -> None:
        length = (stop - start) * self.chunk_bytes
        for layer in range(self.num_layers):
            for kv in (0, 1):
                self._mmap(self.base + self._range_offset(slot, layer, kv, start), length, _PROT_READ,
                           _MAP_FIXED | _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)

    def mapped_regions(self) -> int:
        """Shared mappings of the pool's memfd inside this space's reservation now (/proc/self/maps): 0 when none
        is left (the null range's private one is not counted)."""
        self.wait()
        lo, hi = self.base, self.base + self.reserve_bytes
        count = 0
        with open("/proc/self/maps") as f:
            for line in f:
                if f"/memfd:{_MEMFD_NAME}" in line:
                    span, perms = line.split()[:2]
                    start = int(span.split("-", 1)[0], 16)
                    count += lo <= start < hi and perms.endswith("s")
        return count

    def resident_bytes(self) -> int:
        """Bytes of the physical pool backed by memory (shmem pages written at least once)."""
        return os.fstat(self.fd).st_blocks * 512


def memfd_mappings() -> int:
    """Lines of /proc/self/maps that map a pagemill KV memfd (the pool view and every chunk mapping)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if f"/memfd:{_MEMFD_NAME}" in line)
