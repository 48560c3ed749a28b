"""The model runner for kv_cache_layout="virtual": the KV pool is a memfd whose chunks are mapped into per-request
contiguous ranges (worker/virtual_kv.py) as block tables grow, one chunk ahead (the scheduler allocates the block of
a request's next token a step early; its chunk is mapped in the background during the step before the one that
writes it); everything else is the paged runner's."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import SchedulerOutput
from pagemill.worker.model_runner import ModelRunner
from pagemill.worker.virtual_kv import VirtualKVSpace, VirtualRanges, max_chunk_mappings

logger = logging.getLogger(__name__)

_FULL_ATTENTION_ONLY = ("kv_cache_layout='virtual' supports full-attention models only; this model has "
                        "sliding-window layers: use kv_cache_layout='paged'.")


class VirtualKVModelRunner(ModelRunner):
    """ModelRunner whose KV cache is a VirtualKVSpace: the scheduler's blocks are its physical chunks."""

    kv_space: VirtualKVSpace

    def load_model(self) -> None:
        """The paged runner's model; a model with sliding-window layers is refused (one KV cache group only)."""
        if self.backend.name != "virtual":
            raise ValueError(f"kv_cache_layout='virtual' with attention_backend={self.config.attention_backend!r} "
                             "runs on the GPU worker (worker_cls=pagemill.worker.gpu_worker.GpuWorker).")
        try:
            super().load_model()
        except ValueError as e:
            if "sliding-window" not in str(e):
                raise
            raise ValueError(_FULL_ATTENTION_ONLY) from e
        if len(self.kv_groups) != 1:
            raise ValueError(_FULL_ATTENTION_ONLY)

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        """The paged runner's cache over the memfd pool; each layer reads its K and V through its slots' ranges."""
        kv_cache_config = super().initialize_kv_cache(num_blocks)
        for pos, layer in enumerate(self.model.attention_layers()):
            layer.virtual_kv = (self.kv_space.range_view(pos, 0), self.kv_space.range_view(pos, 1))
        return kv_cache_config

    def cap_num_blocks(self, num_blocks: int) -> int:
        """At most as many blocks as fit one mapping per chunk of every layer's K and V under vm.max_map_count
        (each chunk is its own mapping unless its neighbour holds the next block)."""
        cap = max_chunk_mappings() // (2 * self.group_size)
        if num_blocks <= cap:
            return num_blocks
        logger.warning("kv_cache_layout='virtual': %d KV blocks instead of %d, so that their mappings (%d layers x "
                       "K/V each) fit under vm.max_map_count; a larger block_size keeps more tokens.", cap,
                       num_blocks, self.group_size)
        return cap

    def _allocate_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The memfd pool (its paged view) and the reserved per-slot ranges."""
        mc = self.config.model_config
        layers, _, num_blocks, block_size, num_kv_heads, head_dim = shape
        self.kv_space = VirtualKVSpace(layers, num_blocks, block_size, num_kv_heads, head_dim, self.kv_dtype,
                                       self.config.scheduler_config.max_num_seqs, mc.max_model_len)
        return self.kv_space.pool

    def _update_states(self, so: SchedulerOutput) -> None:
        """The paged runner's updates, then: rows that left release their ranges (lazily); the step's rows map the
        chunks the step reads now (in steady-state decode, already mapped a step ahead) and start mapping the
        chunks the scheduler allocated ahead (the next step's) in the background, while the forward runs."""
        release_rows(self.kv_space, self.input_batch, so)
        super()._update_states(so)
        map_step(self.kv_space, self.input_batch, so)


def release_rows(space: VirtualRanges, ib, so: SchedulerOutput) -> None:
    """Before the input batch drops them: the rows of finished and preempted requests release their ranges."""
    for rid in (*so.finished_req_ids, *so.preempted_req_ids):
        row = ib.req_id_to_row.get(rid)
        if row is not None:
            space.release(row)


def map_step(space: VirtualRanges, ib, so: SchedulerOutput) -> None:
    """After the input batch took the step's block tables: map the chunks the step reads (now) and those allocated
    ahead (in the background where the space does that); an idle batch gives every mapping back."""
    if not ib.req_id_to_row:  # idle: nothing reads the ranges
        space.trim()
        return
    count = len(so.num_scheduled_tokens)
    rows = np.fromiter((ib.req_id_to_row[r] for r in so.num_scheduled_tokens), dtype=np.int64, count=count)
    scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=count)
    computed = ib.num_computed_tokens[rows]
    have = ib.num_blocks[rows]
    bs = space.block_size
    need = np.minimum(-(-(computed + scheduled) // bs), have)  # chunks this step reads
    first_new = np.minimum(-(-computed // bs), need)  # the first chunk this step writes into first
    space.prepare_step(rows, ib.block_table[0], first_new, need, have)
