"""The Llama family in one implementation: Llama / SmolLM2, Mistral, Qwen2 (QKV bias)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.kernels import ops
from pagemill.layers.attention import Attention
from pagemill.layers.norm import RMSNorm
from pagemill.layers.rotary import RotaryEmbedding


def input_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear layer computes in (a converted layer may hold no plain weight to ask)."""
    return linear.weight.dtype if isinstance(linear, nn.Linear) else linear.dtype


class LlamaAttention(nn.Module):
    """Self-attention with a fused QKV projection, RoPE and paged KV."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5,
                              sliding_window=sliding_window, layer_idx=layer_idx)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(h)
        return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary, input_dtype(self.o_proj)))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h), input_dtype(self.down_proj)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary, qkv_bias, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self._matmul_dtypes: tuple[torch.dtype, torch.dtype] | None = None

    def forward(self, positions: torch.Tensor, h: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's MLP output, the residual stream before it); the next norm adds the two."""
        qkv_dtype, gate_up_dtype = self._matmul_dtypes or self._find_matmul_dtypes()
        if residual is None:
            residual = h
            h = self.input_layernorm(h, out_dtype=qkv_dtype)
        else:
            h, residual = self.input_layernorm(h, residual, qkv_dtype)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual, gate_up_dtype)
        return self.mlp(h), residual

    def _find_matmul_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """Input dtypes of the QKV and gate/up matmuls (fixed once the linears are converted; cached)."""
        self._matmul_dtypes = (input_dtype(self.self_attn.qkv_proj), input_dtype(self.mlp.gate_up_proj))
        return self._matmul_dtypes


class LlamaForCausalLM(nn.Module):
    """Llama-architecture causal LM over a flattened batch of tokens: forward(input_ids, positions)."""

    qkv_bias_default = False

    def __init__(self, config, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        qkv_bias = getattr(config, "attention_bias", self.qkv_bias_default) or self.qkv_bias_default
        window = self._sliding_window(config)
        rotary = RotaryEmbedding(config, max_position, dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, qkv_bias, window) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def _sliding_window(config) -> int | None:
        if getattr(config, "use_sliding_window", True) is False:
            return None
        return getattr(config, "sliding_window", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the final norm, for T flattened tokens."""
        h = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h, residual, self.embed_tokens.weight.dtype)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for selected hidden states."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden).to(hidden.dtype)

    def attention_layers(self) -> list[Attention]:
        """The Attention layers, in order (the runner binds KV caches to them)."""
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up into their packed projections.

        A tensor may also be any object with `shape` and `load_into(dst)` (it then writes its values itself).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            placement = self.weight_target(name)
            if placement is None:
                continue
            target, offset, size = placement
            if target not in params:
                raise ValueError(f"weight {name!r} does not fit the {type(self).__name__} model.")
            param = params[target]
            with torch.no_grad():
                dst = param if size is None else param.narrow(0, offset, size)
                if dst.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}.")
                if isinstance(tensor, torch.Tensor):
                    dst.copy_(tensor)
                else:  # a lazily decoded checkpoint tensor (GGUF): written straight into the parameter
                    tensor.load_into(dst)
            loaded.add(target if size is None else f"{target}:{offset}")
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + ":") for k in loaded)]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def weight_target(self, name: str) -> tuple[str, int, int | None] | None:
        """Where a checkpoint (HF-named) tensor goes: (parameter name, row offset, row count or None for the
        whole parameter), or None for a tensor the model does not use."""
        if "rotary_emb.inv_freq" in name:
            return None
        name = name.removeprefix("model.")
        if name.startswith("lm_head") and self.lm_head is None:
            return None
        return self._packed_target(name)

    def _packed_target(self, name: str) -> tuple[str, int, int | None]:
        """(fused parameter name, row offset, row count) for a per-projection HF name."""
        attn_sizes = {
            "q_proj": (0, self.layers[0].self_attn.q_size),
            "k_proj": (self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size),
            "v_proj": (self.layers[0].self_attn.q_size + self.layers[0].self_attn.kv_size,
                       self.layers[0].self_attn.kv_size),
        }
        for proj, (off, size) in attn_sizes.items():
            if f".self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), off, size
        inter = self.config.intermediate_size
        if ".mlp.gate_proj." in name:
            return name.replace("gate_proj", "gate_up_proj"), 0, inter
        if ".mlp.up_proj." in name:
            return name.replace("up_proj", "gate_up_proj"), inter, inter
        return name, 0, None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with a bias on the Q/K/V projections."""

    qkv_bias_default = True


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with an optional sliding attention window."""
