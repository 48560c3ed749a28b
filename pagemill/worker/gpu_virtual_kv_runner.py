"""The GPU runner for kv_cache_layout="virtual" (vTensor): each request slot's K and V of a layer are one contiguous
range of device memory (worker/cuda_virtual_kv.py on CUDA; the host's memfd ranges when the runner runs on the CPU,
as CI tests it), and the paged Triton kernel reads a layer's ranges as a cache whose block b is range b: a request's
block table is one entry (its slot + 1) and its keys are read at consecutive addresses, with no per-page gather."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagemill.core.sched_output import SchedulerOutput
from pagemill.worker.gpu_model_runner import GpuModelRunner
from pagemill.worker.virtual_kv import VirtualKVSpace, VirtualRanges, max_chunk_mappings
from pagemill.worker.virtual_kv_runner import _FULL_ATTENTION_ONLY, map_step, release_rows

logger = logging.getLogger(__name__)


class GpuVirtualKVModelRunner(GpuModelRunner):
    """GpuModelRunner whose KV cache is a virtual range space: the scheduler's blocks are its physical chunks."""

    kv_cache_layout = "virtual"
    kv_space: VirtualRanges

    def __init__(self, config, parallel=None) -> None:
        super().__init__(config, parallel)
        if self.backend.name != "triton":
            raise ValueError("kv_cache_layout='virtual' on the GPU runner reads its ranges with the Triton kernel: "
                             f"attention_backend={config.attention_backend!r} cannot be used (leave it auto).")

    def load_model(self) -> None:
        """The GPU runner's model; sliding-window layers are refused (one KV cache group only)."""
        super().load_model()
        if len(self.kv_groups) != 1:
            raise ValueError(_FULL_ATTENTION_ONLY)

    def _allocate_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The chunk pool (its paged view: copy-on-write, swap) and the reserved per-slot ranges."""
        layers, _, num_blocks, block_size, num_kv_heads, head_dim = shape
        args = (layers, num_blocks, block_size, num_kv_heads, head_dim, self.kv_dtype,
                self.config.scheduler_config.max_num_seqs, self.config.model_config.max_model_len)
        if self.is_cuda:
            from pagemill.worker.cuda_virtual_kv import CudaVirtualKVSpace

            self.kv_space = CudaVirtualKVSpace(*args, device=self.device)
            logger.info("virtual KV (CUDA VMM): %d chunks of %.2f MiB (granularity %.0f MiB) made and mapped in "
                        "%.2fs; %.1f GiB of ranges reserved", layers * 2 * num_blocks,
                        self.kv_space.chunk_bytes / 2**20, self.kv_space.granularity / 2**20,
                        self.kv_space.setup_seconds, self.kv_space.reserve_bytes / 2**30)
        else:
            self.kv_space = VirtualKVSpace(*args)
        return self.kv_space.pool

    def cap_num_blocks(self, num_blocks: int) -> int:
        """On the host, as many blocks as fit vm.max_map_count (one mapping per chunk); CUDA has no such cap."""
        if self.is_cuda:
            return num_blocks
        return min(num_blocks, max_chunk_mappings() // (2 * self.group_size))

    def _bind_layer_caches(self) -> None:
        """Each attention layer reads and writes its K/V through its ranges (blocks = null range, then slots)."""
        for pos, layer in enumerate(self.model.attention_layers()):
            layer.kv_cache = self.kv_space.layer_view(pos)

    def _kv_addresses(self, rows: np.ndarray, token_req: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                      slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One block per request (its slot's range, index slot + 1); a token's slot is its position in that range."""
        ranges = rows + 1
        return ranges[None, :, None], (ranges[token_req] * self.kv_space.range_tokens + positions)[None, :]

    def _update_states(self, so: SchedulerOutput) -> None:
        """The paged runner's updates between the rows' release of their ranges and the step's mappings."""
        release_rows(self.kv_space, self.input_batch, so)
        super()._update_states(so)
        map_step(self.kv_space, self.input_batch, so)

    def profile_run(self) -> int:
        """The GPU runner's profile, then its temporary chunks and ranges given back at once."""
        try:
            return super().profile_run()
        finally:
            space = self.__dict__.pop("kv_space", None)
            if space is not None and hasattr(space, "close"):
                space.close()
