"""Qwen3: Llama with a per-head RMSNorm on q and k before RoPE (and no Q/K/V bias unless configured)."""

from __future__ import annotations

from typing import Any

from pagemill.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 (dense)."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """QK norm on."""
        return DecoderSpec.from_hf_config(hf_config, qk_norm=True)
