"""BERT (encoder-only): word + position + token-type embeddings, post-LN layers with a GELU MLP, bidirectional
attention within each request. `BertModel` embeds; `BertForSequenceClassification` is a cross-encoder (pooler +
classifier over the first token). No KV cache: a request's whole prompt is computed in one step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.layers.encoder_attention import EncoderAttention
from pagemill.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagemill.models.weights import load_checkpoint_weights

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"BERT hidden_act {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)}).")
    return _ACTIVATIONS[name]


class BertEmbeddings(nn.Module):
    """Sum of word, absolute position and token-type embeddings, then LayerNorm."""

    def __init__(self, config: Any, ctx: LayerContext) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT position_embedding_type must be 'absolute', "
                             f"got {config.position_embedding_type!r}.")
        kw = dict(dtype=ctx.dtype)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, **kw)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size, **kw)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, **kw)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """[T] ids, positions and segment ids (None: all 0) -> [T, hidden]."""
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            h = h + self.token_type_embeddings.weight[0]
        else:
            h = h + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(h)


class BertSelfAttention(nn.Module):
    """The fused query/key/value projection and bidirectional attention (HF's `attention.self`)."""

    def __init__(self, config: Any, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        heads = config.num_attention_heads
        head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, heads, True, ctx,
                                          [f"{prefix}.{p}" for p in ("query", "key", "value")])
        self.attn = EncoderAttention(heads, head_dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] (before the output projection)."""
        return self.attn(self.qkv_proj(h))


class BertOutput(nn.Module):
    """dense, then LayerNorm of the residual sum (HF's `attention.output` and `output`)."""

    def __init__(self, in_size: int, config: Any, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_size, config.hidden_size, True, ctx, f"{prefix}.dense")
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=ctx.dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """LayerNorm(dense(h) + residual)."""
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    """Self-attention with its output block."""

    def __init__(self, config: Any, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, ctx, f"{prefix}.self")
        self.output = BertOutput(config.hidden_size, config, ctx, f"{prefix}.output")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.output(self.self(h), h)


class BertIntermediate(nn.Module):
    """The MLP's up projection and activation."""

    def __init__(self, config: Any, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True, ctx, f"{prefix}.dense")
        self.act = _activation(config.hidden_act)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, intermediate]."""
        return self.act(self.dense(h))


class BertLayer(nn.Module):
    """Post-LN transformer block: attention, then the MLP, each followed by a residual LayerNorm."""

    def __init__(self, config: Any, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.attention = BertAttention(config, ctx, f"{prefix}.attention")
        self.intermediate = BertIntermediate(config, ctx, f"{prefix}.intermediate")
        self.output = BertOutput(config.intermediate_size, config, ctx, f"{prefix}.output")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        h = self.attention(h)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    """The stack of layers."""

    def __init__(self, config: Any, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, ctx, f"{prefix}.layer.{i}")
                                   for i in range(config.num_hidden_layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        for layer in self.layer:
            h = layer(h)
        return h


class _BertBase(nn.Module):
    """Weight loading shared by the BERT classes."""

    packed_modules_mapping = {"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}

    def attention_layers(self) -> list:
        """No attention layer keeps a KV cache."""
        return []

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named checkpoint tensors."""
        load_checkpoint_weights(self, weights, self.packed_modules_mapping, self.checkpoint_targets)


class BertPooler(nn.Module):
    """tanh(dense(hidden of the first token)): the input of a BERT classifier."""

    def __init__(self, config: Any, ctx: LayerContext) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=ctx.dtype)

    def forward(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> [B, hidden]."""
        return torch.tanh(self.dense(first_token_hidden))


class BertModel(_BertBase):
    """BERT for embeddings: forward gives the last layer's hidden states of every token (HF's last_hidden_state)."""

    def __init__(self, config: Any, ctx: LayerContext, prefix: str = "", with_pooler: bool = False) -> None:
        super().__init__()
        self.config = config
        p = f"{prefix}." if prefix else ""
        self.embeddings = BertEmbeddings(config, ctx)
        self.encoder = BertEncoder(config, ctx, f"{p}encoder")
        self.pooler = BertPooler(config, ctx) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[T] flattened tokens of the step's requests -> [T, hidden]."""
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids))

    def checkpoint_targets(self, name: str) -> list[str]:
        """Checkpoints of BertModel, or of BERT with a head (its `bert.` prefix); heads and the pooler unused."""
        name = name.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.", "classifier.")) or name.endswith("position_ids"):
            return []
        return [name]


class BertForSequenceClassification(_BertBase):
    """A BERT cross-encoder: classifier(tanh(pooler(hidden of the first token)))."""

    def __init__(self, config: Any, ctx: LayerContext) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, ctx, prefix="bert", with_pooler=True)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, dtype=ctx.dtype)

    @property
    def num_labels(self) -> int:
        """Logits per input."""
        return self.classifier.out_features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[T] flattened tokens -> [T, hidden] (the pooler reads the first token of each request)."""
        return self.bert(input_ids, positions, token_type_ids)

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> [B, num_labels] logits."""
        return self.classifier(self.bert.pooler(first_token_hidden))

    def checkpoint_targets(self, name: str) -> list[str]:
        """HF names as they are; buffers skipped."""
        return [] if name.endswith("position_ids") else [name]
