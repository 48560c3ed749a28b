"""Mistral: Llama with an optional sliding attention window on every layer."""

from __future__ import annotations

from pagemill.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral (the window comes from the config's `sliding_window`)."""
