"""Fused mixture-of-experts: top-k routing, and every expert's gated MLP over its own tokens in one pass.

The experts' weights are stacked (gate+up [E, 2I, H], down [E, H, I]); the (token, expert) pairs are sorted by
expert once, each *active* expert runs one GEMM (a GEMV at decode) over its contiguous rows (all of them in one
torch grouped_mm call), and the weighted rows go back to their tokens. No per-token Python loop, and experts that got no token cost nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.layers.quantization.base import copy_into

# a per-expert checkpoint weight: <prefix>.experts.<e>.<projection>.weight
_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# torch >= 2.10: every expert's GEMM in one call (on CPU, the same BLAS GEMMs as one torch.mm per expert)
_GROUPED_MM = getattr(F, "grouped_mm", None)


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): softmax over the logits in float32, the top k, divided by
    their sum when `renormalize` (Mixtral, Qwen3-MoE; Qwen2-MoE as configured)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act_and_mul: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                  grouped_mm: bool = True) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t.

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; act_and_mul([gate | up], dtype) -> act(gate) *
    up. The k contributions of a token are summed in top-k order, as HF's grouped experts do. `grouped_mm`: the
    experts' GEMMs in one torch grouped_mm call where torch has it, else one torch.mm per active expert.
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # the (token, expert) pairs grouped by expert
    offsets = torch.cumsum(torch.bincount(flat_ids, minlength=w13.shape[0]), 0, dtype=torch.int32)
    # With fewer (token, expert) rows than experts most experts are idle: one mm per active expert (benchmarks/moe.py,
    # Zen 5, 8 experts top-2, batch 1: 1,630 vs 1,379 tok/s with grouped_mm; from batch 32 the two are within noise).
    use_grouped = grouped_mm and _GROUPED_MM is not None and flat_ids.numel() >= w13.shape[0]
    gemm = _grouped_gemm if use_grouped else _per_expert_gemm
    rows = x.index_select(0, order // top_k)
    out = gemm(act_and_mul(gemm(rows, w13, offsets), x.dtype), w2, offsets)
    out *= topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
    # back to (token, rank) order, then each token's k rows summed
    return out.new_empty(out.shape).index_copy_(0, order, out).view(num_tokens, top_k, hidden).sum(dim=1)


def _grouped_gemm(rows: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [S, in] grouped by expert (group e ends at offsets[e]) times w[e]^T ([E, out, in]): one torch call."""
    return _GROUPED_MM(rows, w.transpose(1, 2), offs=offsets)


def _per_expert_gemm(rows: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """As _grouped_gemm, one torch.mm per expert with rows (experts without any are skipped)."""
    out = rows.new_empty(rows.shape[0], w.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(rows[start:end], w[expert].t(), out=out[start:end])
        start = end
    return out


class FusedMoE(nn.Module):
    """E gated-MLP experts with stacked weights, routed top-k: forward(x, router_logits) -> [T, hidden].

    Loads the per-expert checkpoint weights real checkpoints store (`experts.<e>.<gate|up|down>.weight`, named by
    `proj_names`); the model's `checkpoint_targets` sends them here through `expert_target`.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 ctx: LayerContext, activation: str = "silu",
                 proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        if ctx.tp_size > 1:
            raise ValueError("MoE layers do not run tensor-parallel yet (use tensor_parallel_size=1).")
        if activation != "silu":
            raise ValueError(f"MoE experts support the silu activation only, got {activation!r}.")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.proj_names = proj_names
        self.act_and_mul = ctx.ops.silu_and_mul
        dtype = ctx.dtype
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the experts read and return."""
        return self.w13_weight.dtype

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], router_logits [T, E] -> the routed experts' weighted sum [T, hidden]."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return fused_experts(x.to(self.input_dtype), self.w13_weight, self.w2_weight, weights, ids, self.act_and_mul)

    def _slot(self, param: str) -> torch.Tensor:
        """The rows of the stacked weights one per-expert parameter name (`<projection>:<expert>`) stands for."""
        proj, _, expert = param.partition(":")
        if proj not in self.proj_names or not expert.isdigit() or int(expert) >= self.num_experts:
            raise ValueError(f"this MoE layer has no {param!r}")
        e, inter = int(expert), self.intermediate_size
        if proj == self.proj_names[2]:
            return self.w2_weight[e]
        return self.w13_weight[e].narrow(0, 0 if proj == self.proj_names[0] else inter, inter)

    def load_weight(self, param: str, loaded: Any, shard_id: Any = None) -> list[Any]:
        """One expert's gate, up or down checkpoint weight into the stacked weights."""
        copy_into(self._slot(param), loaded)
        return [None]

    def expected_weights(self) -> set[tuple[str, Any]]:
        """Every expert's three projections."""
        return {(f"{p}:{e}", None) for e in range(self.num_experts) for p in self.proj_names}


def expert_target(name: str) -> str | None:
    """The loader name of a per-expert checkpoint weight (`<prefix>.experts.<e>.<proj>.weight` ->
    `<prefix>.experts.<proj>:<e>`, the FusedMoE's parameter for it); None for any other weight."""
    m = _EXPERT_WEIGHT.match(name)
    return None if m is None else f"{m['prefix']}.{m['proj']}:{m['expert']}"


def split_stacked_experts(weights: Iterable[tuple[str, Any]],
                          proj_names: tuple[str, str, str]) -> Iterator[tuple[str, Any]]:
    """Checkpoint weights with stacked experts (transformers 5's in-memory layout: `experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]) split into the per-expert weights hub checkpoints store; the rest as they are."""
    gate, up, down = proj_names
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix.rpartition(".")[2] != "experts" or leaf not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            raise ValueError(f"weight {name!r}: stacked experts must be a 3-d float tensor")
        for e in range(tensor.shape[0]):
            if leaf == "down_proj":
                yield f"{prefix}.{e}.{down}.weight", tensor[e]
            else:
                g, u = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.{gate}.weight", g
                yield f"{prefix}.{e}.{up}.weight", u
