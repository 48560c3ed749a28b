"""The collectives of one tensor-parallel group (vLLM's GroupCoordinator): shared memory where the ranks share a host
and the tensor fits its slots, else torch.distributed (gloo)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pagemill.distributed.shm_communicator import ShmCommunicator


class GroupCoordinator:
    """All-reduce / all-gather over the ranks of one group; `device_group` is the torch.distributed group."""

    def __init__(self, ranks: list[int], rank_in_group: int, device_group: Any,
                 shm: ShmCommunicator | None = None) -> None:
        self.ranks, self.rank_in_group, self.world_size = ranks, rank_in_group, len(ranks)
        self.device_group = device_group
        self.shm = shm

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group's ranks, in place; returns `tensor`."""
        if self.shm is not None and self.shm.supports(tensor):
            return self.shm.all_reduce(tensor)
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors concatenated along the last dimension, in rank order."""
        if self.shm is not None and self.shm.supports(tensor):
            return self.shm.all_gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def destroy(self) -> None:
        """Unmap the shared-memory segment (collectives after this use gloo)."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
