"""What the MoE families share: the sparse feed-forward block (router, fused experts, optional gated shared expert)
and a decoder-kit model whose layers are sparse or dense as its `MoESpec` says."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.layers.fused_moe import FusedMoE, expert_target, split_stacked_experts
from pagemill.layers.linear import ColumnParallelLinear
from pagemill.models.decoder import DecoderForCausalLM, DecoderSpec, GatedMLP


@dataclass(frozen=True)
class MoESpec:
    """The routed experts of an MoE family, as data (read from the HF config)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k weights divided by their sum
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense gated MLP
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one, behind a sigmoid gate)

    @staticmethod
    def qwen_sparse_layers(hf_config: Any) -> tuple[bool, ...]:
        """Qwen-MoE's rule: layer i is sparse unless listed in `mlp_only_layers`, and only every
        `decoder_sparse_step`-th layer is."""
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        return tuple(i not in dense and hf_config.num_experts > 0 and (i + 1) % step == 0
                     for i in range(hf_config.num_hidden_layers))


class SparseMoeBlock(nn.Module):
    """Router logits -> top-k experts (fused), plus sigmoid(shared_expert_gate(h)) * shared_expert(h) if configured."""

    def __init__(self, spec: DecoderSpec, moe: MoESpec, ctx: LayerContext, prefix: str,
                 proj_names: tuple[str, str, str]) -> None:
        super().__init__()
        self.gate = ColumnParallelLinear(spec.hidden_size, moe.num_experts, False, ctx, f"{prefix}.gate")
        self.experts = FusedMoE(moe.num_experts, moe.top_k, spec.hidden_size, moe.intermediate_size, moe.renormalize,
                                ctx, spec.activation, proj_names)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(spec, ctx, f"{prefix}.shared_expert", moe.shared_expert_intermediate_size)
            self.shared_expert_gate = ColumnParallelLinear(spec.hidden_size, 1, False, ctx,
                                                           f"{prefix}.shared_expert_gate")

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the block reads (its input norm emits it)."""
        return self.experts.input_dtype

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        # .forward, not __call__: no module hooks here (as the decoder kit's hot path)
        out = self.experts.forward(h, self.gate(h))
        if self.shared_expert is not None:
            shared = torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert.forward(h)
            out = out + shared.to(out.dtype)
        return out


class MoEForCausalLM(DecoderForCausalLM):
    """A decoder-kit causal LM with MoE feed-forward blocks; a family gives `moe_spec` (and its checkpoint names)."""

    # an expert's gate, up and down projections as the family's checkpoints name them
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # checkpoint module names the family's checkpoints use for ours (Mixtral: block_sparse_moe -> mlp)
    checkpoint_renames: dict[str, str] = {}

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        """This family's experts from its HF config."""
        raise NotImplementedError(f"{cls.__name__} must define moe_spec")

    def build_mlp(self, layer_idx: int, ctx: LayerContext, prefix: str) -> nn.Module:
        """The sparse block on the spec's sparse layers, the dense gated MLP (intermediate_size) on the others."""
        moe = self.moe_spec(self.config)
        if moe.sparse_layers[layer_idx]:
            return SparseMoeBlock(self.spec, moe, ctx, prefix, self.expert_proj_names)
        return GatedMLP(self.spec, ctx, prefix)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """As the decoder kit; stacked expert tensors (transformers 5's in-memory layout) are split per expert first."""
        super().load_weights(split_stacked_experts(weights, self.expert_proj_names))

    def checkpoint_targets(self, name: str) -> list[str]:
        """The family's module renames, and per-expert weights sent to their layer's stacked experts."""
        for old, new in self.checkpoint_renames.items():
            name = name.replace(f".{old}.", f".{new}.")
        target = expert_target(name)
        if target is not None:
            return [target] if self._holds(target) else []
        return super().checkpoint_targets(name)
