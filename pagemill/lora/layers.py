"""LinearWithLoRA: a linear layer plus the LoRA deltas of every adapter slot, applied to a whole step's tokens.

Each slot holds one adapter; a fused projection (q/k/v, gate/up) gives each of its shards its own rank-wide part
of the slot. The runner orders a step's requests so that the tokens of one adapter are contiguous (within the
attention backend's decode / prefill order), and the step's mapping lists those runs of tokens once per step (an
int32 [R, 3] tensor of (first token, end, slot)): for each run [a, b) of slot s the delta is

    y[a:b] += (x[a:b] @ A[s]) @ B[s]        A[s]: [in, W], B[s]: [W, out] (scaled; zero outside a part's shard)

computed for all runs by one call of the layer ops' `lora_delta` per linear: the compiled kernel
(csrc/cpu/variant/lora.cpp: register-blocked, each adapter's A and B read once per block of rows, threads over
output columns) or, without it, the torch reference (two matmuls per run). Whatever the batch mixes (adapters
and the base model): no forward per adapter, no per-token weight copies, and no work for the tokens of other
adapters (multiplying every token by all slots' stacked A under a mask measured 1.5x slower at 32 tokens, 2x at
512; the per-run torch matmuls spent ~0.9 ms per layer on per-op overhead at 32 decode tokens over 4 adapters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagemill.forward_context import get_lora_mapping
from pagemill.kernels.ops import TorchLayerOps
from pagemill.lora.peft_adapter import LoRAModuleWeights


@dataclass
class LoRAMapping:
    """A step's runs of tokens that use an adapter: int32 [R, 3] rows of (first token, end, slot), sorted and
    disjoint; tokens in no run use the base model only."""

    runs: torch.Tensor


class LinearWithLoRA(nn.Module):
    """A LinearBase plus stacked LoRA slots; `forward` adds the delta of each token's adapter (none: base only)."""

    def __init__(self, base: nn.Module, num_slots: int, rank: int, ops: TorchLayerOps | None = None) -> None:
        super().__init__()
        self.base = base
        self.ops = ops or TorchLayerOps()  # whose lora_delta computes the step's deltas
        self.num_subs = len(base.shard_ids)  # one rank-wide part per shard of a fused projection
        self.rank = rank
        self.width = self.num_subs * rank  # columns of A (rows of B) per slot
        dtype = base.input_dtype
        full_in = base.input_size * (base.tp_size if base.split == "row" else 1)
        self.full_input_size = full_in
        # buffers (not saved): they follow the model to its device (the GPU runner moves it after wrapping)
        self.register_buffer("lora_a", torch.zeros(num_slots, base.input_size, self.width, dtype=dtype),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, self.width, base.output_size, dtype=dtype),
                             persistent=False)
        self._reduce = base.split == "row" and base.tp_size > 1

    @property
    def input_dtype(self) -> torch.dtype:
        """The base layer's input dtype."""
        return self.base.input_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]: the base projection plus each token's adapter delta (before a row-parallel sum,
        which is linear, so each rank adds the delta of its own input slice)."""
        base = self.base
        y = base.quant_method.apply(base, x)
        m = get_lora_mapping()
        if m is not None:
            self.ops.lora_delta(y, x, self.lora_a, self.lora_b, m.runs)
        if self._reduce:
            base.tp_group.all_reduce(y)
        return y

    def check(self, module: str, shards: list[int], w: LoRAModuleWeights) -> None:
        """Raise a ValueError unless adapter module `module` (covering `shards`) fits this layer's shapes."""
        base = self.base
        out_full = sum(base.output_sizes[j] * (base.tp_size if base.split == "column" else 1) for j in shards)
        if w.a.shape[1] != self.full_input_size or w.b.shape[0] != out_full:
            raise ValueError(f"lora_path: module {module!r} has A {list(w.a.shape)} and B {list(w.b.shape)}; the "
                             f"model's layer needs A [r, {self.full_input_size}] and B [{out_full}, r].")

    def set_slot(self, slot: int, parts: list[tuple[int, list[int], LoRAModuleWeights]]) -> None:
        """Write an adapter's modules into `slot`; `parts`: (which rank-wide part of the slot, the shards the module
        covers, its weights) per module (a module of one shard uses that shard's part, of the whole fused layer
        part 0). An empty list clears the slot."""
        base = self.base
        lora_a, lora_b = self.lora_a[slot], self.lora_b[slot]
        lora_a.zero_()
        lora_b.zero_()
        for sub, shards, w in parts:
            a, b = w.a, w.b * w.scaling  # [r, in], [out, r]
            if base.split == "row" and base.tp_size > 1:
                a = a.narrow(1, base.tp_rank * base.input_size, base.input_size)
            r = a.shape[0]
            start = sub * self.rank
            lora_a[:, start:start + r] = a.t().to(lora_a.dtype)
            row = 0
            for j in shards:  # B's rows, shard after shard (each cut to this rank's part when column-parallel)
                full = base.output_sizes[j] * (base.tp_size if base.split == "column" else 1)
                part = b.narrow(0, row, full)
                if base.split == "column" and base.tp_size > 1:
                    part = part.narrow(0, base.tp_rank * base.output_sizes[j], base.output_sizes[j])
                out = slice(base.shard_offsets[j], base.shard_offsets[j] + base.output_sizes[j])
                lora_b[start:start + r, out] = part.t().to(lora_b.dtype)
                row += full
