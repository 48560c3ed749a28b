"""This process's place in the tensor x pipeline grid and its torch.distributed groups (vLLM's parallel_state).

Ranks are laid out as vLLM does: global rank = pp_rank * tp_size + tp_rank, so the ranks of one pipeline stage
form one tensor-parallel group, and a stage's tp rank i sends its activations to tp rank i of the next stage.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagemill.platforms import current_platform
from pagemill.utils.import_utils import resolve_obj_by_qualname


@dataclass(frozen=True)
class ParallelContext:
    """Ranks and groups of one worker (the defaults: a single process, no collectives)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # GroupCoordinator of this stage's tensor-parallel ranks (None: one rank)

    @property
    def rank(self) -> int:
        """The global rank."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        """All ranks."""
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank embeds the tokens."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes the logits."""
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """Whether this rank's sampled tokens are the engine's (the last stage's first tensor-parallel rank)."""
        return self.is_last_stage and self.tp_rank == 0

    def send_next(self, tensor: torch.Tensor) -> None:
        """Send activations to the same tensor-parallel rank of the next stage."""
        dist.send(tensor.contiguous(), self.rank + self.tp_size)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive activations from the same tensor-parallel rank of the previous stage."""
        out = torch.empty(shape, dtype=dtype)
        dist.recv(out, self.rank - self.tp_size)
        return out


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers pipeline stage `pp_rank` holds (vLLM's even split; earlier stages take
    the remainder's extra layers)."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) is larger than the model's {num_layers} layers.")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str,
                     timeout_s: float = 600.0) -> ParallelContext:
    """Join the process group of all ranks (the platform's backend: gloo on the CPU) and build this rank's
    tensor-parallel group, with the platform's device communicator for its collectives where it can run (on the CPU,
    shared memory where the group's ranks share a host: see shm_communicator)."""
    from pagemill.distributed.group_coordinator import GroupCoordinator

    world = tp_size * pp_size
    dist.init_process_group(current_platform.dist_backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    create_communicator = resolve_obj_by_qualname(current_platform.device_communicator)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    for stage in range(pp_size):  # every rank creates every group (torch.distributed's rule), keeps its own
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if stage == pp_rank and group is not None:
            comm = create_communicator(group, tp_rank, tp_size, timeout_s)
            tp_group = GroupCoordinator(ranks, tp_rank, group, comm)
    return ParallelContext(tp_rank, tp_size, pp_rank, pp_size, tp_group)
