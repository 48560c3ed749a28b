"""Linear layers' own weight loaders: fused shards, tensor-parallel slices, missing and misshapen weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagemill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagemill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, vocab_range
from pagemill.models.weights import load_checkpoint_weights
from tests.layers.helpers import layer_context


def _qkv(ctx, bias: bool = True) -> QKVParallelLinear:
    return QKVParallelLinear(16, 4, 4, 2, bias, ctx, ["a.q_proj", "a.k_proj", "a.v_proj"])


def test_qkv_shards_land_in_their_rows():
    torch.manual_seed(0)
    layer = _qkv(layer_context(kernels=False))
    q, k, v = torch.randn(16, 16), torch.randn(8, 16), torch.randn(8, 16)
    for shard, w in (("v", v), ("q", q), ("k", k)):  # any order
        layer.load_weight("weight", w, shard)
        layer.load_weight("bias", w[:, 0], shard)
    layer.process_weights_after_loading()
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    assert torch.equal(layer.bias, torch.cat([q[:, 0], k[:, 0], v[:, 0]]))
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), x @ torch.cat([q, k, v]).T + layer.bias)


def test_wrong_shard_shape_and_unknown_shard_are_errors():
    layer = _qkv(layer_context(kernels=False))
    with pytest.raises(ValueError, match="rows"):
        layer.load_weight("weight", torch.randn(9, 16), "k")
    with pytest.raises(ValueError, match="shape"):
        layer.load_weight("weight", torch.randn(8, 15), "k")
    with pytest.raises(ValueError, match="shard"):
        layer.load_weight("weight", torch.randn(8, 16), "x")


class _Block(nn.Module):
    def __init__(self, ctx) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(16, [24, 24], False, ctx, ["mlp.gate_proj", "mlp.up_proj"])
        self.down_proj = RowParallelLinear(24, 16, False, ctx, "mlp.down_proj")


def test_checkpoint_loader_reports_missing_shards_and_unknown_names():
    mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    block = _Block(layer_context(kernels=False))
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['gate_up_proj.weight \(1\)'\]"):
        load_checkpoint_weights(block, [("gate_proj.weight", torch.randn(24, 16)),
                                        ("down_proj.weight", torch.randn(16, 24))], mapping)
    with pytest.raises(ValueError, match="'router.weight' does not fit"):
        load_checkpoint_weights(_Block(layer_context(kernels=False)), [("router.weight", torch.randn(2, 2))], mapping)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_slices_reassemble_the_weight(tp_size):
    """Column-parallel ranks hold row slices of each shard, row-parallel ranks column slices; the vocabulary splits
    into equal row ranges. Concatenated over ranks they give the checkpoint's tensors back."""
    torch.manual_seed(tp_size)
    gate, up, down = torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)
    embed = torch.randn(40, 16)
    blocks, embeddings, heads = [], [], []
    for rank in range(tp_size):
        ctx = layer_context(kernels=False, tp_rank=rank, tp_size=tp_size)
        block = _Block(ctx)
        block.gate_up_proj.load_weight("weight", gate, 0)
        block.gate_up_proj.load_weight("weight", up, 1)
        block.down_proj.load_weight("weight", down)
        blocks.append(block)
        embedding = VocabParallelEmbedding(40, 16, ctx)
        embedding.load_weight("weight", embed)
        embeddings.append(embedding.weight)
        head = ParallelLMHead(40, 16, ctx, "lm_head.weight")
        head.load_weight("weight", embed)
        heads.append(head.weight)
        assert vocab_range(40, rank, tp_size) == (rank * 40 // tp_size, (rank + 1) * 40 // tp_size)
    per = 24 // tp_size
    assert torch.equal(torch.cat([b.gate_up_proj.weight[:per] for b in blocks]), gate)
    assert torch.equal(torch.cat([b.gate_up_proj.weight[per:] for b in blocks]), up)
    assert torch.equal(torch.cat([b.down_proj.weight for b in blocks], dim=1), down)
    assert torch.equal(torch.cat(embeddings), embed) and torch.equal(torch.cat(heads), embed)
    with pytest.raises(ValueError, match="split"):
        MergedColumnParallelLinear(16, [25, 25], False, layer_context(kernels=False, tp_size=tp_size), ["a", "b"])


def test_tied_head_shares_the_embedding_or_keeps_its_own_form():
    ctx = layer_context(kernels=False)
    embedding = VocabParallelEmbedding(40, 16, ctx)
    head = ParallelLMHead(40, 16, ctx, "model.embed_tokens.weight", tied_to=embedding)
    assert head.shares_embedding and head.weight is embedding.weight and not head.expected_weights()
    fp16 = layer_context(linear_dtype="float16")
    head16 = ParallelLMHead(40, 16, fp16, "model.embed_tokens.weight", tied_to=VocabParallelEmbedding(40, 16, fp16))
    assert not head16.shares_embedding and head16.expected_weights() == {("weight", None)}


def test_fused_checkpoint_tensor_is_split_into_shards():
    """Phi-3 stores qkv_proj itself: one tensor fills the three shards (and a wrong row count is an error)."""
    torch.manual_seed(1)
    layer = _qkv(layer_context(kernels=False), bias=False)
    fused = torch.randn(32, 16)
    assert layer.load_weight("weight", fused) == ["q", "k", "v"]
    layer.process_weights_after_loading()
    assert torch.equal(layer.weight, fused)
    with pytest.raises(ValueError, match="33 rows, expected 32"):
        layer.load_weight("weight", torch.randn(33, 16))
