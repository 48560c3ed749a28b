"""Mixtral: Mistral attention with every feed-forward block a top-k (renormalised) mixture of SwiGLU experts."""

from __future__ import annotations

from typing import Any

from pagemill.models.moe import MoEForCausalLM, MoESpec


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral 8x7B / 8x22B and their likes (experts named w1 = gate, w3 = up, w2 = down)."""

    expert_proj_names = ("w1", "w3", "w2")
    checkpoint_renames = {"block_sparse_moe": "mlp"}

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        """All layers sparse; the top-k weights always renormalised."""
        return MoESpec(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.intermediate_size, renormalize=True,
                       sparse_layers=(True,) * hf_config.num_hidden_layers)
