"""Long contexts in the CPU kernel: a token's keys are attended in parts of 512 and merged (split over the threads
when the work items are few), against the torch reference, bit-for-bit the same whichever way the parts ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagemill.attention.backends.torch_paged import TorchPagedAttention
from pagemill.attention.metadata import CommonAttentionMetadata
from tests.attention.test_backends import _batch, _fused_inputs, _kernel_layout, _Layer
from tests.attention.test_kv_quant_kernels import _kernel_layout as _quant_kernel_layout
from tests.attention.test_kv_quant_kernels import _quantized_cache


def _num_blocks(specs: list[tuple[int, int]], block_size: int) -> int:
    """Cache blocks enough for every request of a _batch (block 0 is never used)."""
    return 2 + sum(-(-(c + n) // block_size) for c, n in specs)


def _two_threads(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _request(md: CommonAttentionMetadata, i: int) -> tuple[CommonAttentionMetadata, slice]:
    """The metadata of the batch's request i alone, and its tokens' rows in the batch."""
    a, b = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
    alone = CommonAttentionMetadata(1, int(b - a == 1), b - a, np.array([0, b - a]), md.seq_lens[i:i + 1],
                                    md.num_computed_tokens[i:i + 1], md.block_table[i:i + 1], md.block_size,
                                    md.slot_mapping[a:b])
    return alone, slice(a, b)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hk", [(9, 3), (8, 1)])
def test_long_contexts_match_reference(window, block_size, hq, hk):
    """Decodes past one and several parts, a verify-like tile across a part boundary, a chunk with 1,030 cached
    tokens and a fresh 600-token prefill; a window of 300 leaves early parts out of later tokens' reach."""
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(3)
    specs = [(1500, 1), (700, 1), (5, 1), (508, 8), (1030, 40), (0, 600)]  # decodes first, as the runner orders
    md, cache, q, k, v = _batch(rng, specs, block_size, _num_blocks(specs, block_size), hk,
                                32, hq)
    layer = _Layer(hq, hk, 32, window)
    torch_backend, cpu_backend = TorchPagedAttention(), CpuPagedAttention()
    ref = torch_backend.forward(layer, q, k, v, cache.clone(), torch_backend.build_metadata(md))
    out = _two_threads(lambda: cpu_backend.forward(layer, q, k, v, _kernel_layout(cache),
                                                   cpu_backend.build_metadata(md)))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("hq,hk", [(9, 3), (4, 1)])
def test_parts_split_over_threads_equal_parts_in_turn(n, hq, hk):
    """One long request alone (few work items: its parts are spread over the threads and merged after) gives the
    same bits as in a batch (each item takes its parts in turn), for a decode and a tile of 8 tokens."""
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(4)
    # decodes first, as the runner orders them; the long request's tile of 8 after them
    specs = [(1700, n)] + [(int(c), 1) for c in rng.integers(1, 900, 9)]
    specs = sorted(specs, key=lambda s: s[1] > 1)
    md, cache, q, k, v = _batch(rng, specs, 16, _num_blocks(specs, 16), hk, 64, hq)
    layer, backend = _Layer(hq, hk, 64, None), CpuPagedAttention()
    kc = _kernel_layout(cache)
    batched = _two_threads(lambda: backend.forward(layer, q, k, v, kc.clone(), backend.build_metadata(md)))
    md1, rows = _request(md, specs.index((1700, n)))
    alone = _two_threads(lambda: backend.forward(layer, q[rows], k[rows], v[rows], kc.clone(),
                                                 backend.build_metadata(md1)))
    ref = TorchPagedAttention().forward(layer, q[rows], k[rows], v[rows], cache.clone(),
                                        TorchPagedAttention().build_metadata(md1))
    assert torch.equal(alone, batched[rows])
    torch.testing.assert_close(alone, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_cache_long_context(dtype):
    """A quantized cache read in parts: the kernel equals the torch reference on the same codes."""
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(5)
    specs = [(1300, 1), (600, 5)]
    md, cache, q, k, v = _batch(rng, specs, 16, _num_blocks(specs, 16), 3, 64, 9)
    qcache = _quantized_cache(cache, dtype)
    layer = _Layer(9, 3, 64, None)
    torch_backend, cpu_backend = TorchPagedAttention(), CpuPagedAttention()
    ref = torch_backend.forward(layer, q, k, v, qcache.clone(), torch_backend.build_metadata(md))
    out = _two_threads(lambda: cpu_backend.forward(layer, q, k, v, _quant_kernel_layout(qcache),
                                                   cpu_backend.build_metadata(md)))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_merged_parts_write_reduced_precision_output(out_dtype):
    """forward_fused into a bfloat16 / float16 output over long contexts: the merge writes the output dtype."""
    from pagemill.attention.backends.cpu_paged import CpuPagedAttention

    rng = np.random.default_rng(6)
    specs = [(1300, 1), (600, 5)]
    hq, hk, d = 9, 3, 64
    md, cache, q, k, v = _batch(rng, specs, 16, _num_blocks(specs, 16), hk, d, hq)
    layer = _Layer(hq, hk, d, None)
    rotary, positions, qkv, q_rot, k_rot = _fused_inputs(specs, q, k, v, 2048)
    torch_backend, cpu_backend = TorchPagedAttention(), CpuPagedAttention()
    ref = torch_backend.forward(layer, q_rot, k_rot, v, cache.clone(), torch_backend.build_metadata(md))
    out = _two_threads(lambda: cpu_backend.forward_fused(layer, qkv, positions, rotary.cos, rotary.sin,
                                                         _kernel_layout(cache), cpu_backend.build_metadata(md),
                                                         out_dtype))
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=1e-2)
