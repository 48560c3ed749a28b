"""Llama (and SmolLM2, Llama 3): the decoder kit with HF's Llama config as it is."""

from __future__ import annotations

from pagemill.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama: pre-norm blocks, SwiGLU, RoPE, optional attention / MLP biases."""
