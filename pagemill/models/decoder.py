"""The decoder kit: the pieces decoder-only families share, assembled from a `DecoderSpec`.

A family is a spec (QKV bias, QK norm, norm style and placement, activation, per-layer sliding window and RoPE,
embedding scale) plus what is truly new about it; Llama, Qwen2, Qwen3 and Mistral are specs only. A family whose
feed-forward block differs per layer (MoE) overrides `DecoderForCausalLM.build_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagemill.layers.attention import Attention
from pagemill.layers.context import LayerContext
from pagemill.distributed.parallel_state import layer_range
from pagemill.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                    kv_heads_per_rank)
from pagemill.layers.norm import RMSNorm
from pagemill.layers.rotary import RotaryEmbedding
from pagemill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagemill.models.weights import load_checkpoint_weights

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class DecoderSpec:
    """Everything that tells one decoder-only family from another, as data (read from the HF config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer (None: full attention)
    rope_layer_types: tuple[str | None, ...]  # per layer: which of the config's RoPE parameter sets (None: the one)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # a per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    norm_one_plus: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    sandwich_norm: bool = False  # norms after attention and MLP too, before the residual adds (Gemma 2 / 3)
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> DecoderSpec:
        """The spec of a Llama-like HF config; a family passes what differs as overrides."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        n = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in layer_types)
        elif getattr(config, "use_sliding_window", True) is False:
            windows = (None,) * n
        else:
            windows = (getattr(config, "sliding_window", None),) * n
        params = getattr(config, "rope_parameters", None) or {}
        per_type = layer_types is not None and all(t in params for t in set(layer_types))
        spec = dict(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=n, num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=windows, rope_layer_types=tuple(layer_types) if per_type else (None,) * n,
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)), mlp_bias=bool(getattr(config, "mlp_bias", False)))
        spec.update(overrides)
        return cls(**spec)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}.")


class DecoderAttention(nn.Module):
    """The attention block: fused QKV projection, optional QK norm, RoPE + paged attention, output projection."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, ctx: LayerContext,
                 prefix: str) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                          spec.qkv_bias, ctx, [f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj")])
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, spec.o_bias, ctx,
                                        f"{prefix}.o_proj")
        q_norm = k_norm = None
        if spec.qk_norm:
            q_norm = self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ctx.ops, one_plus=spec.norm_one_plus)
            k_norm = self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ctx.ops, one_plus=spec.norm_one_plus)
        scale = spec.attn_scale or spec.head_dim**-0.5
        num_kv_heads = kv_heads_per_rank(spec.num_heads, spec.num_kv_heads, ctx.tp_size)
        self.attn = Attention(spec.num_heads // ctx.tp_size, spec.head_dim, num_kv_heads, scale,
                              ctx, rotary, self.o_proj.input_dtype, spec.sliding_windows[layer_idx], q_norm, k_norm,
                              layer_idx)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        # attn.forward, not attn(...): no module hooks here, and nn.Module.__call__ costs ~1 us per layer per step
        return self.o_proj(self.attn.forward(self.qkv_proj(h), positions))


class GatedMLP(nn.Module):
    """act(gate) * up, then down: fused gate/up projection (SwiGLU or GeGLU)."""

    def __init__(self, spec: DecoderSpec, ctx: LayerContext, prefix: str, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [inter, inter], spec.mlp_bias, ctx,
                                                       [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, spec.mlp_bias, ctx, f"{prefix}.down_proj")
        ops = ctx.ops
        self.act_and_mul = ops.silu_and_mul if spec.activation == "silu" else ops.gelu_tanh_and_mul
        self.act_dtype = self.down_proj.input_dtype

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the block reads (its input norm emits it)."""
        return self.gate_up_proj.input_dtype

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act_and_mul(self.gate_up_proj(h), self.act_dtype))


# (layer index, LayerContext, module prefix) -> the layer's feed-forward block: [T, hidden] -> [T, hidden], with an
# `input_dtype` property
MLPFactory = Callable[[int, LayerContext, str], nn.Module]


class DecoderLayer(nn.Module):
    """A transformer block; norms fused with the residual adds (vLLM style), their placement from the spec.

    Each norm emits the dtype its consumer reads (the next matmul's input dtype, or the residual stream's).
    """

    def __init__(self, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, ctx: LayerContext,
                 prefix: str, mlp_factory: MLPFactory | None = None) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(spec, layer_idx, rotary, ctx, f"{prefix}.self_attn")
        self.mlp = (mlp_factory(layer_idx, ctx, f"{prefix}.mlp") if mlp_factory is not None
                    else GatedMLP(spec, ctx, f"{prefix}.mlp"))

        def norm(out_dtype: torch.dtype) -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, ctx.ops, out_dtype, spec.norm_one_plus)

        self.input_layernorm = norm(self.self_attn.qkv_proj.input_dtype)
        self.sandwich = spec.sandwich_norm
        if self.sandwich:  # HF names: post_attention_layernorm normalises the attention output here
            self.post_attention_layernorm = norm(ctx.dtype)
            self.pre_feedforward_layernorm = norm(self.mlp.input_dtype)
            self.post_feedforward_layernorm = norm(ctx.dtype)
        else:  # Llama: post_attention_layernorm is the MLP's input norm
            self.post_attention_layernorm = norm(self.mlp.input_dtype)

    def forward(self, positions: torch.Tensor, h: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's output, the residual stream before it); the next norm adds the two."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h)
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class PPMissingLayer(nn.Identity):
    """The place of a module another pipeline stage holds (vLLM's name); it has no weights."""


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (HF's `model.` prefix). A pipeline stage builds only its own
    layers (the embedding on the first, the norm on the last) and passes (hidden, residual) on to the next."""

    def __init__(self, spec: DecoderSpec, hf_config: Any, ctx: LayerContext, prefix: str = "model",
                 mlp_factory: MLPFactory | None = None) -> None:
        super().__init__()
        self.parallel = pp = ctx.parallel
        self.start_layer, self.end_layer = layer_range(spec.num_layers, pp.pp_rank, pp.pp_size)
        self.hidden_size, self.dtype = spec.hidden_size, ctx.dtype
        self.embed_tokens = (VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, ctx) if pp.is_first_stage
                             else PPMissingLayer())
        self.embed_scale = spec.embed_scale
        ropes = {t: RotaryEmbedding(hf_config, ctx.max_position, ctx.dtype, t) for t in set(spec.rope_layer_types)}
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, ropes[spec.rope_layer_types[i]], ctx, f"{prefix}.layers.{i}", mlp_factory)
            if self.start_layer <= i < self.end_layer else PPMissingLayer() for i in range(spec.num_layers))
        self.norm = (RMSNorm(spec.hidden_size, spec.rms_norm_eps, ctx.ops, ctx.dtype, spec.norm_one_plus)
                     if pp.is_last_stage else PPMissingLayer())

    def holds(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` (under this module's prefix) belongs to this pipeline stage."""
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers":
            return self.start_layer <= int(parts[2]) < self.end_layer
        if len(parts) > 1 and parts[1] == "embed_tokens":
            return self.parallel.is_first_stage
        if len(parts) > 1 and parts[1] == "norm":
            return self.parallel.is_last_stage
        return True

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ids [T] -> [T, hidden] (scaled where the family scales them)."""
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the final norm, for T flattened tokens (after the first `num_layers`
        layers only, when given: a draft model made of the model's own first layers). A stage before the last sends
        its (hidden, residual) to the next stage and returns its hidden states. `inputs_embeds`: the input
        embeddings to use instead of the token ids' (a multimodal model's, with its images merged in)."""
        pp = self.parallel
        if pp.is_first_stage:
            h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            h, residual = pp.recv_prev((2, input_ids.shape[0], self.hidden_size), self.dtype).unbind(0)
        for layer in self.layers[self.start_layer:self.end_layer if num_layers is None else num_layers]:
            h, residual = layer(positions, h, residual)
        if not pp.is_last_stage:
            pp.send_next(torch.stack((h, residual)))
            return h
        return self.norm(h, residual)[0]


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM over a flattened batch of tokens: forward(input_ids, positions) -> hidden states,
    compute_logits(hidden) -> logits. Families subclass it with `decoder_spec` (and weight-name quirks)."""

    # checkpoint module name -> (fused module, shard id)
    packed_modules_mapping: dict[str, tuple[str, Any]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config: Any, ctx: LayerContext) -> None:
        super().__init__()
        self.config = hf_config
        self.spec = self.decoder_spec(hf_config)
        self.model = DecoderModel(self.spec, hf_config, ctx, mlp_factory=self.build_mlp)
        tied = self.spec.tie_word_embeddings
        pp = ctx.parallel
        # (a pipeline's last stage reads a tied head's weight from the checkpoint: the embedding is on the first)
        self.lm_head = (ParallelLMHead(self.spec.vocab_size, self.spec.hidden_size, ctx,
                                       "model.embed_tokens.weight" if tied else "lm_head.weight",
                                       tied_to=self.model.embed_tokens if tied and pp.is_first_stage else None)
                        if pp.is_last_stage else PPMissingLayer())

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """This family's spec from its HF config."""
        return DecoderSpec.from_hf_config(hf_config)

    def build_mlp(self, layer_idx: int, ctx: LayerContext, prefix: str) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block: the gated MLP (MoE families override it)."""
        return GatedMLP(self.spec, ctx, prefix)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for T flattened tokens."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for selected hidden states."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """This stage's Attention layers, in order (the runner binds KV caches to them)."""
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start_layer:self.model.end_layer]]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named checkpoint tensors (torch tensors or lazy GGUF weights) and prepare every layer."""
        load_checkpoint_weights(self, weights, self.packed_modules_mapping, self.checkpoint_targets)

    def checkpoint_targets(self, name: str) -> list[str]:
        """The parameter names a checkpoint tensor loads into (a tied embedding also feeds the LM head)."""
        if "rotary_emb.inv_freq" in name:
            return []
        if self.spec.tie_word_embeddings:
            if name.startswith("lm_head."):
                return []
            if name == "model.embed_tokens.weight":
                return [t for t in (name, "lm_head.weight") if self._holds(t)]
        return [name] if self._holds(name) else []

    def _holds(self, name: str) -> bool:
        """Whether a model parameter name belongs to this pipeline stage."""
        if name.startswith("lm_head."):
            return self.model.parallel.is_last_stage
        return not name.startswith("model.") or self.model.holds(name)
