"""Per-token key limits (image tokens that attend to their whole image, Gemma 3): the torch reference and the cpu
backend (its kernel, then the limited requests from the cache) against dense masked attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagemill.attention.backends.torch_paged import TorchPagedAttention
from tests.attention.test_backends import _batch, _kernel_layout, _Layer

# (context_len, query_len) in the runner's order: a decode, context chunks (one starting inside an image, one
# without images), fresh prefills
SPECS = [(5, 1), (17, 12), (9, 10), (30, 4), (0, 25), (0, 3)]
# per request, (start, end) image runs its new tokens hold (positions; end exclusive)
SPANS = [[], [(20, 26)], [(6, 14)], [], [(2, 10), (12, 20)], []]


def _limits(specs, spans) -> np.ndarray:
    """Position + 1, or the run's end for a token inside a run."""
    out = []
    for (c, q), runs in zip(specs, spans):
        lim = np.arange(c + 1, c + q + 1)
        for s, e in runs:
            p = np.arange(c, c + q)
            lim[(p >= s) & (p < e)] = e
        out.append(lim)
    return np.concatenate(out)


def _dense(layer, q, k, v, cache, md, limits) -> torch.Tensor:
    """Attention of every new token over its request's cached + new keys under `limits` (and the window)."""
    out = torch.empty_like(q)
    bs = md.block_size
    for i in range(md.num_reqs):
        s, e = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        ctx, seq = int(md.num_computed_tokens[i]), int(md.seq_lens[i])
        pos = np.arange(ctx)
        slots = torch.from_numpy(md.block_table[i, pos // bs] * bs + pos % bs)
        keys = torch.cat([cache[0].reshape(-1, *cache.shape[3:])[slots], k[s:e]])
        vals = torch.cat([cache[1].reshape(-1, *cache.shape[3:])[slots], v[s:e]])
        kpos, qpos = np.arange(seq)[None, :], np.arange(ctx, seq)[:, None]
        allowed = kpos < limits[s:e, None]
        if layer.sliding_window is not None:
            allowed &= kpos > qpos - layer.sliding_window
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           vals.transpose(0, 1)[None], attn_mask=torch.from_numpy(allowed),
                                           scale=layer.scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


def test_limits_beyond_causal_change_the_result():
    rng = np.random.default_rng(1)
    md, cache, q, k, v = _batch(rng, SPECS, 4, 64, 2, 16, 4)
    layer = _Layer(4, 2, 16, None)
    causal = _dense(layer, q, k, v, cache, md, _limits(SPECS, [[]] * len(SPECS)))
    assert not torch.allclose(causal, _dense(layer, q, k, v, cache, md, _limits(SPECS, SPANS)))


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("backend", ["torch", "cpu", "cpu_invariant"])
def test_backends_follow_key_limits(backend, window):
    rng = np.random.default_rng(0)
    md, cache, q, k, v = _batch(rng, SPECS, 4, 64, 2, 16, 4)
    md.key_limits = _limits(SPECS, SPANS)
    layer = _Layer(4, 2, 16, window)
    ref = _dense(layer, q, k, v, cache, md, md.key_limits)
    if backend == "torch":
        b = TorchPagedAttention()
        out = b.forward(layer, q, k, v, cache.clone(), b.build_metadata(md))
    else:
        from pagemill.attention.backends.cpu_invariant import BatchInvariantCpuAttention
        from pagemill.attention.backends.cpu_paged import CpuPagedAttention

        b = CpuPagedAttention() if backend == "cpu" else BatchInvariantCpuAttention()
        out = b.forward(layer, q, k, v, _kernel_layout(cache), b.build_metadata(md))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
