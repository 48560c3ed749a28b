"""Qwen2: Llama with a bias on the Q/K/V projections (none on the output projection)."""

from __future__ import annotations

from typing import Any

from pagemill.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Q/K/V biases; sliding windows per layer from the config's layer types."""
        return DecoderSpec.from_hf_config(hf_config, qkv_bias=True, o_bias=False)
