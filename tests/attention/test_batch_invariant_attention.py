"""The batch-invariant CPU attention backend: a query's output bits are the same whether its request is prefilled
whole, in chunks or in a batch with other requests (the default backend's SDPA prefill gives other bits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagemill.attention.backends.cpu_invariant import BatchInvariantCpuAttention
from pagemill.attention.backends.cpu_paged import CpuPagedAttention
from pagemill.attention.metadata import CommonAttentionMetadata
from tests.conftest import requires_kernels

pytestmark = requires_kernels

HQ, HK, D, BS, NUM_BLOCKS = 6, 2, 32, 16, 24
TARGET_LEN = 45


class _Layer:
    def __init__(self, window: int | None) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = HQ, HK, D
        self.scale, self.sliding_window, self.qk_norm = D**-0.5, window, None


def _metadata(parts: list[tuple[np.ndarray, int, int]]) -> CommonAttentionMetadata:
    """A step of requests given as (block table row, tokens cached before, new tokens), in the runner's order."""
    counts = np.array([n for _, _, n in parts])
    ctx = np.array([c for _, c, _ in parts])
    qsl = np.concatenate([[0], np.cumsum(counts)])
    table = np.stack([row for row, _, _ in parts])
    pos = np.concatenate([np.arange(c, c + n) for _, c, n in parts])
    req = np.repeat(np.arange(len(parts)), counts)
    slots = table[req, pos // BS] * BS + pos % BS
    return CommonAttentionMetadata(len(parts), int((counts == 1).sum()), int(qsl[-1]), qsl, ctx + counts, ctx, table,
                                   BS, torch.from_numpy(slots))


def _target_outputs(backend: CpuPagedAttention, layer: _Layer, qkv: tuple[torch.Tensor, ...],
                    steps: list[list[tuple[str, int, int]]]) -> torch.Tensor:
    """The target request's attention outputs [TARGET_LEN, HQ, D] over `steps`, each a list of (request, cached,
    new) in batch order; "t" is the target (its q/k/v rows [cached, cached + new)), others draw random q/k/v."""
    tables = {"t": np.arange(1, 4), "a": np.arange(4, 7), "b": np.arange(7, 10)}
    cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BS, HK, D))
    rng = torch.Generator().manual_seed(7)
    out = torch.full((TARGET_LEN, HQ, D), float("nan"))
    for step in steps:
        md = _metadata([(tables[r], c, n) for r, c, n in step])
        parts = [tuple(x[c:c + n] for x in qkv) if r == "t" else
                 (torch.randn(n, HQ, D, generator=rng), torch.randn(n, HK, D, generator=rng),
                  torch.randn(n, HK, D, generator=rng)) for r, c, n in step]
        q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
        o = backend.forward(layer, q, k, v, cache, backend.build_metadata(md))
        start = 0
        for r, c, n in step:
            if r == "t":
                out[c:c + n] = o[start:start + n]
            start += n
    return out


SCENARIOS = {
    "whole": [[("t", 0, TARGET_LEN)]],
    "chunks": [[("t", 0, 5)], [("t", 5, 16)], [("t", 21, 24)]],
    "batch": [[("a", 0, 20)], [("a", 20, 1), ("t", 0, TARGET_LEN), ("b", 0, 9)]],
    "chunks_in_batch": [[("t", 0, 30), ("a", 0, 12)], [("a", 12, 1), ("t", 30, 15), ("b", 0, 3)]],
    "token_by_token": [[("t", i, 1)] for i in range(TARGET_LEN)],
    # speculative verification: several tokens over cached context, alone and beside other requests
    "verify": [[("t", 0, 29)], [("t", 29, 8)], [("a", 0, 4), ("t", 37, 8), ("b", 0, 1)]],
}


@pytest.mark.parametrize("window", [None, 9])
def test_query_outputs_do_not_depend_on_chunks_or_batch(window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(TARGET_LEN, HQ, D, generator=g), torch.randn(TARGET_LEN, HK, D, generator=g),
           torch.randn(TARGET_LEN, HK, D, generator=g))
    layer = _Layer(window)
    invariant = BatchInvariantCpuAttention()
    outs = {name: _target_outputs(invariant, layer, qkv, steps) for name, steps in SCENARIOS.items()}
    for name, out in outs.items():
        assert torch.equal(out, outs["whole"]), f"{name}: the target's attention changed"
    default = CpuPagedAttention()
    whole = _target_outputs(default, layer, qkv, SCENARIOS["whole"])  # SDPA
    torch.testing.assert_close(whole, outs["whole"], atol=2e-5, rtol=1e-4)
    # the default backend: a fresh prefill (SDPA) and the same tokens in chunks (the kernel) round differently
    assert not torch.equal(whole, _target_outputs(default, layer, qkv, SCENARIOS["chunks"]))
