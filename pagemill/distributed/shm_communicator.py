"""A shared-memory all-reduce / all-gather for the tensor-parallel ranks of one host (vLLM's CPU backend has one too).

The collectives themselves are C++ (`csrc/shm/shm_comm.cpp`: per-rank slots, sequence counters, spin-then-yield waits).
Here the ranks agree, over their gloo group, on whether to use it: every rank must want it (its own extension,
`pagemill_shm`, is built; `PAGEMILL_CPU_SHM_ALLREDUCE` is not 0), run on the same host, and open the segment group
rank 0 created and see the others' processes. Rank 0 then removes the segment's name at once, so nothing is left
behind, even after a crash.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ENABLE_ENV = "PAGEMILL_CPU_SHM_ALLREDUCE"  # 0: gloo only
MAX_BYTES_ENV = "PAGEMILL_CPU_SHM_ALLREDUCE_MAX_BYTES"  # the largest tensor (per rank) sent through shared memory
DEFAULT_MAX_BYTES = 4 << 20
SEGMENT_PREFIX = "pagemill-tp-"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shm_enabled() -> bool:
    """Whether this process wants the shared-memory collectives (PAGEMILL_CPU_SHM_ALLREDUCE, default on)."""
    value = os.environ.get(ENABLE_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"{ENABLE_ENV} must be 0 or 1, got {value!r}.")
    return value not in ("0", "false", "off")


def max_bytes() -> int:
    """The slot size: tensors up to this many bytes go through shared memory (a multiple of 64)."""
    raw = os.environ.get(MAX_BYTES_ENV, "")
    try:
        value = int(raw) if raw.strip() else DEFAULT_MAX_BYTES
    except ValueError:
        raise ValueError(f"{MAX_BYTES_ENV} must be a number of bytes, got {raw!r}.") from None
    if value < 64:
        raise ValueError(f"{MAX_BYTES_ENV} must be at least 64, got {value}.")
    return value // 64 * 64


class ShmCommunicator:
    """All-reduce (sum) and all-gather through one shared-memory segment; tensors of a supported dtype up to
    `max_bytes` per rank. Every rank gets bit-identical results (the sum runs in rank order on each)."""

    def __init__(self, comm: Any, rank: int, world_size: int, name: str) -> None:
        self.comm, self.rank, self.world_size = comm, rank, world_size
        self.name = name  # the segment's name while the ranks opened it (removed since)
        self.max_bytes = comm.slot_bytes

    def supports(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` goes through shared memory (it depends only on dtype and size: the same on every rank)."""
        return tensor.nbytes <= self.max_bytes and tensor.dtype in DTYPES and tensor.is_cpu

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (a non-contiguous one through a contiguous copy)."""
        if tensor.is_contiguous():
            self.comm.all_reduce(tensor)
            return tensor
        flat = tensor.contiguous()
        self.comm.all_reduce(flat)
        return tensor.copy_(flat)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors concatenated along the last dimension, in rank order."""
        out = torch.empty((*tensor.shape[:-1], tensor.shape[-1] * self.world_size), dtype=tensor.dtype)
        self.comm.all_gather(out, tensor.contiguous())
        return out

    def barrier(self) -> None:
        """Wait for every rank."""
        self.comm.barrier()

    def close(self) -> None:
        """Unmap the segment; no collective may follow."""
        self.comm.close()


def _all_gather_object(value: Any, group: Any, world_size: int) -> list[Any]:
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value, group=group)
    return out


def _pid_visible(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, owned by another user
        return True
    return True


def create_shm_communicator(group: Any, rank: int, world_size: int,
                            timeout_s: float = 600.0) -> ShmCommunicator | None:
    """Collective over `group` (gloo): a ShmCommunicator on every rank, or None on every rank when some rank cannot
    use one (the reason is logged)."""
    from pagemill.kernels.build import load_shm_comm

    shm, reason = None, f"disabled by {ENABLE_ENV}=0"
    if shm_enabled():
        shm, reason = load_shm_comm()
        reason = None if shm is not None else f"the shm communicator extension is unavailable: {reason}"
    slot = max_bytes()
    infos = _all_gather_object((reason, socket.gethostname(), slot), group, world_size)
    reasons = [info[0] for info in infos if info[0] is not None]
    if reasons:
        _log_fallback(rank, f"not every rank can use shared memory ({reasons[0]})")
        return None
    if len({info[1] for info in infos}) > 1 or len({info[2] for info in infos}) > 1:
        _log_fallback(rank, f"the ranks are on different hosts (or disagree on {MAX_BYTES_ENV})")
        return None

    # group rank 0 creates the segment; the name is unique per engine (pid + random), so engines never collide
    comm, error = None, None
    try:
        setup: list[Any] = [None]
        if rank == 0:
            name, token = f"/{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}", secrets.randbits(63)
            try:
                comm = shm.ShmComm(name, 0, world_size, slot, True, token, timeout_s)
            except RuntimeError as e:
                error = str(e)
            setup = [(name, token, error)]
        dist.broadcast_object_list(setup, group_src=0, group=group)
        name, token, error = setup[0]
        if rank != 0 and error is None:
            try:
                comm = shm.ShmComm(name, rank, world_size, slot, False, token, timeout_s)
            except RuntimeError as e:
                error = str(e)
        opened = _all_gather_object((error, os.getpid()), group, world_size)
    finally:
        if comm is not None and rank == 0:
            comm.unlink()  # every rank has it mapped (or gave up): the name is no longer needed
    errors = [e for e, _ in opened if e is not None]
    # a rank whose peers' processes it cannot see (another pid namespace) could not tell a dead peer from a slow one
    visible = all(_pid_visible(pid) for _, pid in opened)
    all_visible = all(_all_gather_object(visible, group, world_size))
    if errors or not all_visible:
        if comm is not None:
            comm.close()
        _log_fallback(rank, errors[0] if errors else "the ranks run in different process namespaces")
        return None
    shm = ShmCommunicator(comm, rank, world_size, name)
    shm.barrier()  # every rank mapped it and every counter starts at 0
    if rank == 0:
        logger.info("Tensor-parallel collectives of up to %d bytes per rank go through shared memory (%d ranks; "
                    "%s=0 uses gloo only)", slot, world_size, ENABLE_ENV)
    return shm


def _log_fallback(rank: int, reason: str) -> None:
    if rank == 0:
        logger.info("Tensor-parallel collectives use gloo only: %s.", reason)
