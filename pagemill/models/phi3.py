"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama with checkpoints that store the fused qkv_proj and gate_up_proj (the
fused layers split them into their shards) and, in some versions, a partial rotary factor."""

from __future__ import annotations

from pagemill.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 family (dense)."""
