"""Qwen3-MoE: Qwen3 attention (QK norm) with routed experts and no shared expert; dense layers where
`mlp_only_layers` / `decoder_sparse_step` say so."""

from __future__ import annotations

from typing import Any

from pagemill.models.decoder import DecoderSpec
from pagemill.models.moe import MoEForCausalLM, MoESpec


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """QK norm on."""
        return DecoderSpec.from_hf_config(hf_config, qk_norm=True)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        """Renormalised top-k only with `norm_topk_prob` (the released models set it)."""
        return MoESpec(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.moe_intermediate_size,
                       renormalize=bool(hf_config.norm_topk_prob),
                       sparse_layers=MoESpec.qwen_sparse_layers(hf_config))
