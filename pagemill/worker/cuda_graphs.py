"""CUDA graphs for decode batches (vLLM's piecewise-free "full" decode graphs): one graph per bucket size
(step_buffers.decode_buckets: 1, 2, 4, 8, 16, ... max_num_seqs), captured once after the KV cache is allocated, over
the runner's persistent step buffers; a decode step is padded to its bucket (null-block padding) and replays it.
Only imported on CUDA; `enforce_eager=True` skips it. A capture that fails (an op the graph cannot hold) logs why and
leaves the runner eager.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pagemill.forward_context import set_forward_context

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Captured decode graphs by bucket size and their output hidden states."""

    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None

    @classmethod
    def capture(cls, runner: Any) -> DecodeGraphs | None:
        """Capture every bucket, largest first (they share one memory pool); None if capture fails."""
        self = cls()
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        try:
            self.pool = torch.cuda.graph_pool_handle()
            for size in sorted(runner.buckets, reverse=True):
                self._capture_one(runner, size)
        except Exception as exc:  # noqa: BLE001 (any failure: run eagerly, say why)
            logger.warning("CUDA graph capture failed (%s: %s): decode batches run eagerly.", type(exc).__name__, exc)
            torch.cuda.synchronize()
            return None
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("CUDA graphs: %d decode buckets (%s) captured in %.1fs, %.1f MiB", len(self.graphs),
                    ",".join(map(str, sorted(self.graphs))), time.perf_counter() - start, used / 2**20)
        return self

    def _capture_one(self, runner: Any, size: int) -> None:
        """Warm up (Triton compiles) and capture the forward over `size` padded decode tokens."""
        buf = runner.buffers
        # a dummy decode batch: every token padding (null block, position 0)
        groups = len(runner.kv_groups)
        empty = np.zeros(0, dtype=np.int64)
        buf.stage(empty, empty, np.zeros((groups, 0), dtype=np.int64), np.zeros(0, dtype=np.int64),
                  np.zeros((groups, 0, 1), dtype=np.int64), pad_to=size)
        metadata = self._metadata(runner, size)
        ids, pos = buf.views(size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), set_forward_context(metadata, None):
            for _ in range(2):
                runner.model(ids, pos)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), set_forward_context(metadata, None):
            out = runner.model(ids, pos)
        self.graphs[size], self.outputs[size] = graph, out

    @staticmethod
    def _metadata(runner: Any, size: int) -> list:
        """Attention metadata of a `size`-token decode batch whose tensors are the persistent buffers' views."""
        from pagemill.attention.metadata import CommonAttentionMetadata

        buf, bs = runner.buffers, runner.block_size
        out = []
        for g in range(len(runner.kv_groups)):
            slot_mapping, table, req, pos = buf.attn_tensors(g, size)
            ones = np.ones(size, dtype=np.int64)
            common = CommonAttentionMetadata(
                num_reqs=size, num_decodes=size, num_actual_tokens=size,
                query_start_loc=np.arange(size + 1), seq_lens=ones, num_computed_tokens=ones - 1,
                block_table=np.zeros((size, 1), dtype=np.int64), block_size=bs, slot_mapping=slot_mapping,
                device_tensors=(table, req, pos))
            out.append(runner.backend.build_metadata(common))
        return out

    def replay(self, size: int) -> torch.Tensor:
        """Run the captured forward of bucket `size` over what the buffers hold now; its hidden states."""
        self.graphs[size].replay()
        return self.outputs[size]
