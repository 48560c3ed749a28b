"""The pooler on random hidden states: CLS / MEAN / LAST per segment, across chunks, restarts, post-processing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagemill.layers.encoder_attention import EncoderAttentionMetadata, length_groups
from pagemill.layers.pooler import PoolChunk, Pooler
from pagemill.pooling.config import PoolerConfig
from pagemill.pooling_params import PoolingParams


def vec(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


def expected(h: torch.Tensor, kind: str) -> torch.Tensor:
    return {"CLS": h[0], "MEAN": h.mean(0), "LAST": h[-1]}[kind]


@pytest.mark.parametrize("kind", ["CLS", "MEAN", "LAST"])
def test_chunked_pools_equal_whole(kind):
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    seqs = [torch.randn(n, 8) for n in lengths]
    params = PoolingParams(task="embed", normalize=False)
    whole = Pooler(PoolerConfig(pooling_type=kind, normalize=False))
    starts = np.cumsum([0] + lengths[:-1])
    out = whole(torch.cat(seqs), [PoolChunk(f"r{i}", int(s), n, True, True, params)
                                 for i, (s, n) in enumerate(zip(starts, lengths))])
    chunked = Pooler(PoolerConfig(pooling_type=kind, normalize=False))
    got: dict[str, bytes] = {}
    for step in range(3):  # request i's tokens in chunks of 4 per step
        rows, chunks = [], []
        for i, h in enumerate(seqs):
            part = h[4 * step:4 * step + 4]
            if len(part):
                chunks.append(PoolChunk(f"r{i}", sum(len(r) for r in rows), len(part), step == 0,
                                        4 * step + len(part) == len(h), params))
                rows.append(part)
        got.update(chunked(torch.cat(rows), chunks))
    for i, h in enumerate(seqs):
        assert torch.allclose(vec(out[f"r{i}"]), expected(h, kind), atol=1e-6)
        assert torch.allclose(vec(got[f"r{i}"]), expected(h, kind), atol=1e-6)
    assert not chunked._partial


def test_restart_from_first_token_discards_the_partial_pool():
    """A preempted request is recomputed from its first token: its earlier partial pool must not count."""
    pooler = Pooler(PoolerConfig(pooling_type="MEAN", normalize=False))
    p = PoolingParams(task="embed")
    assert pooler(torch.full((3, 2), 100.0), [PoolChunk("a", 0, 3, True, False, p)]) == {}
    out = pooler(torch.ones(3, 2), [PoolChunk("a", 0, 3, True, False, p)])  # restarted
    out = pooler(torch.full((1, 2), 5.0), [PoolChunk("a", 0, 1, False, True, p)])
    assert vec(out["a"]).tolist() == [2.0, 2.0]
    pooler(torch.ones(3, 2), [PoolChunk("b", 0, 3, True, False, p)])
    pooler.drop("b")
    assert not pooler._partial


def test_normalize_and_dimensions_per_request():
    pooler = Pooler(PoolerConfig(pooling_type="LAST", normalize=True, is_matryoshka=True))
    h = torch.tensor([[3.0, 4.0, 12.0], [1.0, 0.0, 0.0]])
    chunks = [PoolChunk("n", 0, 1, True, True, PoolingParams()),
              PoolChunk("raw", 0, 1, True, True, PoolingParams(normalize=False)),
              PoolChunk("d2", 0, 1, True, True, PoolingParams(dimensions=2))]
    out = pooler(h[:1].repeat(3, 1), [PoolChunk(c.req_id, i, 1, True, True, c.params) for i, c in enumerate(chunks)])
    assert torch.allclose(vec(out["n"]), torch.tensor([3.0, 4.0, 12.0]) / 13)
    assert vec(out["raw"]).tolist() == [3.0, 4.0, 12.0]
    assert torch.allclose(vec(out["d2"]), torch.tensor([0.6, 0.8]))


def test_classifier_activation():
    weight = torch.tensor([[1.0, -1.0], [0.5, 0.5]])
    pooler = Pooler(PoolerConfig(pooling_type="CLS", head="classify"), classify=lambda x: x @ weight.T)
    h = torch.tensor([[1.0, 2.0], [9.0, 9.0]])
    out = pooler(h, [PoolChunk("p", 0, 2, True, True, PoolingParams()),
                     PoolChunk("l", 0, 2, True, True, PoolingParams(activation=False))])
    assert torch.allclose(vec(out["p"]), F.softmax(torch.tensor([-1.0, 1.5]), dim=-1))
    assert vec(out["l"]).tolist() == [-1.0, 1.5]


def test_length_groups_bound_the_padding():
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 200, size=60)
    groups = length_groups(counts)
    assert sorted(np.concatenate(groups).tolist()) == list(range(60))
    for g in groups:
        if len(g) > 1:
            assert len(g) * counts[g].max() <= 1.25 * counts[g].sum()
    md = EncoderAttentionMetadata.build(counts)
    rows = torch.cat([g.token_rows for g in md.groups])
    assert sorted(rows.tolist()) == list(range(int(counts.sum())))
