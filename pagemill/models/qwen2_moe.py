"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention, routed experts plus a shared expert behind a sigmoid
gate; dense layers where `mlp_only_layers` / `decoder_sparse_step` say so."""

from __future__ import annotations

from typing import Any

from pagemill.models.decoder import DecoderSpec
from pagemill.models.moe import MoEForCausalLM, MoESpec


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Q/K/V biases as configured (`qkv_bias`), none on the output projection."""
        return DecoderSpec.from_hf_config(hf_config, qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
                                          o_bias=False)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        """Renormalised top-k only with `norm_topk_prob`; the shared expert's size from the config."""
        return MoESpec(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.moe_intermediate_size,
                       renormalize=bool(hf_config.norm_topk_prob),
                       sparse_layers=MoESpec.qwen_sparse_layers(hf_config),
                       shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size)
