"""Read a GGUF file's tensors as (HF parameter name, float tensor) pairs, dequantized with `gguf`."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

# GGUF tensor name (inside blk.N.) -> HF parameter name (inside model.layers.N.)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, model_type: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None if we do not use it."""
    m = _LAYER_RE.match(name)
    if m:
        layer, base, kind = m.groups()
        if model_type.startswith("gemma") and base == "ffn_norm":
            base_name = "pre_feedforward_layernorm"
        else:
            base_name = _LAYER_NAMES.get(base)
        return f"model.layers.{layer}.{base_name}.{kind}" if base_name else None
    base, _, kind = name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return f"{hf}.{kind}" if hf else None


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves the two RoPE halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def iter_gguf_weights(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the GGUF file under its HF name, dequantized to float32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model_type = hf_config.model_type
    reader = GGUFReader(path)
    for t in reader.tensors:
        hf_name = gguf_to_hf_name(t.name, model_type)
        if hf_name is None:
            continue
        arr = dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if model_type == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = hf_config.num_attention_heads if ".attn_q." in t.name else hf_config.num_key_value_heads
            arr = _reverse_permute(arr, heads)
        if model_type.startswith("gemma") and "norm" in t.name:
            arr = arr - 1.0  # GGUF stores Gemma's (1 + w) norm weights
        yield hf_name, torch.from_numpy(arr if arr.flags.writeable else arr.copy())
