"""Batch-invariant CPU attention: every request, fresh prefills included, through the compiled paged kernel.

The kernel computes each (query token, KV head) on its own, over the request's keys block by block from position 0
in one fixed order, so a query's result depends only on its position and the cached K/V, not on the other
requests, the chunk it came in, or a prefix-cache hit. The default backend sends fresh prefills to torch SDPA,
whose blocking depends on the prompt length: a prompt prefilled whole and the same prompt prefilled in chunks (or
after a prefix hit) got different bits.
"""

from __future__ import annotations

import numpy as np
import torch

from pagemill.attention.backends.cpu_paged import CpuAttentionMetadata, CpuPagedAttention
from pagemill.attention.metadata import CommonAttentionMetadata


class BatchInvariantCpuAttention(CpuPagedAttention):
    """CpuPagedAttention with no SDPA path: the kernel takes every request of the step."""

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        """Kernel inputs for all the step's requests."""
        qsl, num = common.query_start_loc, common.num_reqs
        return CpuAttentionMetadata(
            common, num_kernel_reqs=num, num_kernel_tokens=int(qsl[num]),
            block_table=torch.from_numpy(np.ascontiguousarray(common.block_table[:num])),
            query_start_loc=torch.from_numpy(qsl[: num + 1].astype(np.int64)),
            context_lens=torch.from_numpy(common.num_computed_tokens[:num].astype(np.int64)))
