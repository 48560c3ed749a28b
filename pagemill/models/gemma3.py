"""Gemma 3 (text): the decoder kit with (1 + w) norms around both sub-blocks, QK norm, GeGLU, scaled embeddings,
sliding and full attention layers with their own RoPE."""

from __future__ import annotations

from typing import Any

from pagemill.models.decoder import DecoderForCausalLM, DecoderSpec


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 text models (the 270M / 1B ones, and the language part of the larger ones)."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Gemma's differences from Llama, all of them data."""
        return DecoderSpec.from_hf_config(
            hf_config, qk_norm=True, norm_one_plus=True, sandwich_norm=True, activation="gelu_tanh",
            embed_scale=hf_config.hidden_size**0.5, attn_scale=hf_config.query_pre_attn_scalar**-0.5)
