"""vTensor on CUDA (seed 004's own mechanism): physical KV chunks made with the CUDA driver's virtual memory API and
mapped into one reserved virtual range per request slot, so each request's K and V of a layer are contiguous in
device memory and attention reads them without a block table gather.

A chunk is one block of one layer's K or V (`cuMemCreate`, one allocation each: a mapping cannot start inside an
allocation), so block_size * kv_heads * head_dim * dtype bytes must be a multiple of the driver's granularity
(2 MiB on Hopper): a 1B Llama in bf16 takes blocks of 2,048 tokens. Every chunk is mapped twice: once into the pool
reservation, the paged view [layers, K/V, num_blocks, block_size, kv_heads, head_dim] that copy-on-write, swap and
the profile use; and into the ranges of the slots whose block tables hold it (`cuMemMap`, `cuMemSetAccess`), on the
step path before the forward. Unlike the host's reservation an unmapped range faults when read, so nothing reads
past a request's mapped chunks (the kernels read keys below each request's length only), and a remap waits for the
device first (a step in flight may still read the old chunk).
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from pagemill.worker.virtual_kv import VirtualRanges, _Runs


def _driver():
    """cuda-python's driver bindings (cuda-bindings), with a clear error when they are missing."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ValueError("kv_cache_layout='virtual' on CUDA maps KV chunks with the CUDA driver's virtual memory "
                         "API through cuda-python: pip install cuda-bindings (or use kv_cache_layout='paged').") from e
    return driver


def _check(result, what: str):
    """cuda-python returns (CUresult, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"kv_cache_layout='virtual': {what} failed ({err!r})")
    return values[0] if len(values) == 1 else values


class _DeviceMemory:
    """A device address range as a uint8 tensor (torch reads `__cuda_array_interface__`; no copy, no ownership)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.as_tensor(self, device=device)


class CudaVirtualKVSpace(VirtualRanges):
    """The ranges on a CUDA device: one allocation per chunk, a pool reservation mapping all of them, and a range
    reservation ([layers, K/V, 1 + slots, max_chunks, chunk]) whose chunks are mapped as block tables grow."""

    map_ahead_in_background = False  # the driver calls are short; a thread would need the context made current

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, num_slots: int, max_model_len: int, device: torch.device) -> None:
        cu = self._cu = _driver()
        self._init_ranges(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, num_slots,
                          max_model_len)
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self.granularity = int(_check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"))
        if self.chunk_bytes % self.granularity:
            elem = torch.empty((), dtype=dtype).element_size()
            per_token = num_kv_heads * head_dim * elem
            tokens = self.granularity // np.gcd(self.granularity, per_token)
            raise ValueError(f"kv_cache_layout='virtual' on CUDA maps whole {self.granularity}-byte chunks: one "
                             f"layer's K for block_size={block_size} tokens is {self.chunk_bytes} bytes; use a "
                             f"block_size that is a multiple of {tokens}.")
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        # What the finalizer gives back (also when close() is never called): the reservations, every chunk
        # mapping (address -> size) and the allocations.
        self._state = {"pool": (0, self.pool_bytes), "ranges": (0, self.reserve_bytes), "mapped": set(),
                       "handles": [], "chunk": self.chunk_bytes}
        weakref.finalize(self, _release, cu, self._state)
        start = time.perf_counter()
        self._pool_ptr = int(_check(cu.cuMemAddressReserve(self.pool_bytes, self.granularity, 0, 0), "reserve"))
        self._state["pool"] = (self._pool_ptr, self.pool_bytes)
        self.base = int(_check(cu.cuMemAddressReserve(self.reserve_bytes, self.granularity, 0, 0), "reserve"))
        self._state["ranges"] = (self.base, self.reserve_bytes)
        self._init_tables()
        handles = self._state["handles"]
        for i in range(num_layers * 2 * num_blocks):  # handle i: block i % num_blocks of layer/kv i // num_blocks
            handles.append(_check(cu.cuMemCreate(self.chunk_bytes, prop, 0), "cuMemCreate (out of device memory?)"))
            self._map(self._pool_ptr + i * self.chunk_bytes, handles[-1], track=False)
        _check(cu.cuMemSetAccess(self._pool_ptr, self.pool_bytes, self._access, 1), "cuMemSetAccess")
        self.setup_seconds = time.perf_counter() - start
        self.pool = _DeviceMemory(self._pool_ptr, self.pool_bytes).tensor(device).view(dtype).view(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.pool.zero_()
        self._map_run(-1, 0, 0, 1)  # the null range's chunk 0: the null block, for good (torch checks the base)
        self._flat = _DeviceMemory(self.base, self.reserve_bytes).tensor(device).view(dtype)

    # ---- mappings ----
    def _map(self, addr: int, handle, track: bool = True) -> None:
        _check(self._cu.cuMemMap(addr, self.chunk_bytes, 0, handle, 0), "cuMemMap")
        if track:
            self._state["mapped"].add(addr)

    def _unmap(self, addr: int) -> None:
        _check(self._cu.cuMemUnmap(addr, self.chunk_bytes), "cuMemUnmap")
        self._state["mapped"].discard(addr)

    def _map_run(self, slot: int, chunk: int, block: int, n: int) -> None:
        handles = self._state["handles"]
        for layer in range(self.num_layers):
            for kv in (0, 1):
                addr = self.base + self._range_offset(slot, layer, kv, chunk)
                first = (layer * 2 + kv) * self.num_blocks + block
                for j in range(n):  # one allocation per chunk: one cuMemMap each
                    self._map(addr + j * self.chunk_bytes, handles[first + j])
                _check(self._cu.cuMemSetAccess(addr, n * self.chunk_bytes, self._access, 1), "cuMemSetAccess")

    def _unmap_run(self, slot: int, start: int, stop: int) -> None:
        mapped = self._state["mapped"]
        for layer in range(self.num_layers):
            for kv in (0, 1):
                addr = self.base + self._range_offset(slot, layer, kv, start)
                for j in range(stop - start):  # chunk by chunk (one mapping each), holes skipped
                    if addr + j * self.chunk_bytes in mapped:
                        self._unmap(addr + j * self.chunk_bytes)

    def _map_runs(self, runs: _Runs, background: bool) -> None:
        """Chunks mapped to another block are unmapped first, once the device has finished every queued read."""
        old = self.mapped[runs.slots, runs.cols]
        stale = np.flatnonzero(old >= 0)
        if len(stale):
            torch.cuda.synchronize(self.device)
            for i in stale.tolist():
                col = int(runs.cols[i])
                self._unmap_slot_chunks(int(runs.slots[i]), col, col + 1)
        super()._map_runs(runs, background)

    def _trim(self) -> None:
        torch.cuda.synchronize(self.device)
        super()._trim()

    def num_range_mappings(self) -> int:
        """Chunk mappings in the range reservation now (the null range's included)."""
        return len(self._state["mapped"])

    def close(self) -> None:
        """Give the device memory and the reservations back now (the runner dropped every view of them)."""
        torch.cuda.synchronize(self.device)
        self.mapped[:] = -1
        _release(self._cu, self._state)


def _release(cu, state: dict) -> None:
    """Unmap every chunk mapping, free both reservations, release the allocations (idempotent)."""
    chunk = state["chunk"]
    for addr in sorted(state["mapped"]):
        cu.cuMemUnmap(addr, chunk)
    state["mapped"].clear()
    for key in ("pool", "ranges"):
        ptr, size = state[key]
        if ptr:
            if key == "pool":
                for i in range(len(state["handles"])):
                    cu.cuMemUnmap(ptr + i * chunk, chunk)
            cu.cuMemAddressFree(ptr, size)
            state[key] = (0, size)
    for handle in state["handles"]:
        cu.cuMemRelease(handle)
    state["handles"].clear()
