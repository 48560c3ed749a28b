"""Linear layers built with their method (vLLM's linear + quant-method split) and their own weight loaders.

Each layer asks the engine's `QuantConfig` for its method when it is built, from the checkpoint weights it is made
of, and owns the loading of those weights: fused shards (q/k/v, gate/up) go to their row ranges, tensor-parallel
ranks take their slice, and GGUF Q/K rows permuted by llama.cpp are read back in HF order.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.layers.quantization.base import copy_into


class LinearBase(nn.Module):
    """y = x W^T + b through the layer's method; W's rows are one or more shards (a fused projection).

    `split`: "column" partitions the output rows over tensor-parallel ranks, "row" the input columns.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ctx: LayerContext,
                 checkpoint_names: list[str], shard_ids: list[Any] | None = None, split: str = "column") -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.split = ctx.tp_rank, ctx.tp_size, split
        self.tp_group = ctx.tp_group
        self.input_size = input_size // ctx.tp_size if split == "row" else input_size
        self.output_sizes = [o // ctx.tp_size for o in output_sizes] if split == "column" else list(output_sizes)
        if any(o % ctx.tp_size for o in output_sizes) if split == "column" else input_size % ctx.tp_size:
            raise ValueError(f"{checkpoint_names[0]}: sizes {output_sizes} x {input_size} do not split over "
                             f"{ctx.tp_size} ranks.")
        # the checkpoint's rows of each shard (QKVParallelLinear: K/V heads replicated over ranks differ)
        self.full_output_sizes = ([o * ctx.tp_size for o in self.output_sizes] if split == "column"
                                  else self.output_sizes)
        self.shard_ids = shard_ids or [None]
        self.shard_offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self.output_size = sum(self.output_sizes)
        self.quant_method = ctx.quant_config.get_linear_method(checkpoint_names, self.input_size)
        self.quant_method.create_weights(self, self.input_size, self.output_size)
        self.bias = None if not bias else nn.Parameter(torch.empty(self.output_size, dtype=self.input_dtype),
                                                       requires_grad=False)

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the method reads (the op before this layer emits it) and returns."""
        return self.quant_method.input_dtype

    @property
    def weight_format(self) -> str:
        """How the method stores the weight (float32, float16, q4_1, ...)."""
        return self.quant_method.weight_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in input_dtype."""
        return self.quant_method.apply(self, x)

    def load_weight(self, param: str, loaded: Any, shard_id: Any = None) -> list[Any]:
        """A checkpoint tensor (a whole weight or one shard of a fused one) into this layer; returns the shard ids
        it filled. A checkpoint that stores the fused weight itself (Phi-3's qkv_proj / gate_up_proj) is split."""
        if shard_id is None and len(self.shard_ids) > 1:
            if not isinstance(loaded, torch.Tensor):
                raise ValueError("a fused checkpoint tensor must be a float tensor to be split into shards")
            full = self.full_output_sizes
            if loaded.shape[0] != sum(full):
                raise ValueError(f"fused checkpoint tensor has {loaded.shape[0]} rows, expected {sum(full)}.")
            for shard, part in zip(self.shard_ids, loaded.split(full)):
                self.load_weight(param, part, shard)
            return list(self.shard_ids)
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard {shard_id!r} is not one of {self.shard_ids}")
        index = self.shard_ids.index(shard_id)
        loaded = self._this_rank(self.adjust_loaded(loaded, shard_id), param, index)
        if loaded.shape[0] != self.output_sizes[index]:
            raise ValueError(f"checkpoint tensor has {loaded.shape[0]} rows, expected {self.output_sizes[index]}.")
        if param == "weight":
            self.quant_method.load_weight(self, loaded, self.shard_offsets[index], index)
        elif param == "bias" and self.bias is not None:
            if self.split == "row" and self.tp_rank > 0:  # added once, after the reduction
                loaded = torch.zeros(loaded.shape)
            copy_into(self.bias.narrow(0, self.shard_offsets[index], self.output_sizes[index]), loaded)
        else:
            raise ValueError(f"this layer has no {param!r}")
        return [shard_id]

    def adjust_loaded(self, loaded: Any, shard_id: Any) -> Any:
        """Hook for layers whose checkpoint rows need reordering (the QKV projection's GGUF un-permute)."""
        return loaded

    def _this_rank(self, loaded: Any, param: str, index: int = 0) -> Any:
        """This tensor-parallel rank's slice of a checkpoint tensor (of shard `index`)."""
        if self.tp_size == 1:
            return loaded
        loaded = as_float_tensor(loaded)
        if self.split == "column":
            return self.column_slice(loaded, index)
        if param == "bias":
            return loaded
        return loaded.narrow(1, self.tp_rank * self.input_size, self.input_size)

    def column_slice(self, loaded: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's output rows of shard `index` (an equal share)."""
        size = self.output_sizes[index]
        return loaded.narrow(0, self.tp_rank * size, size)

    def expected_weights(self) -> set[tuple[str, Any]]:
        """(param, shard id) pairs the checkpoint must provide."""
        params = ["weight"] + (["bias"] if self.bias is not None else [])
        return {(p, s) for p in params for s in self.shard_ids}

    def process_weights_after_loading(self) -> None:
        """The method prepares what apply() reads (prepacked copies, GEMV records)."""
        self.quant_method.process_weights_after_loading(self)
        if type(self).forward is LinearBase.forward:
            # Hot path: the module call goes straight to the method (a C-level partial, not a Python frame more).
            self.forward = functools.partial(self.quant_method.apply, self)


class ColumnParallelLinear(LinearBase):
    """A linear whose output rows are split over tensor-parallel ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: LayerContext, prefix: str) -> None:
        super().__init__(input_size, [output_size], bias, ctx, [f"{prefix}.weight"])


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of one input fused into one matmul (gate/up); shard i = part i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ctx: LayerContext,
                 checkpoint_prefixes: list[str]) -> None:
        super().__init__(input_size, output_sizes, bias, ctx, [f"{p}.weight" for p in checkpoint_prefixes],
                         shard_ids=list(range(len(output_sizes))))


def as_float_tensor(loaded: Any) -> torch.Tensor:
    """A checkpoint tensor as a float tensor to slice (a lazy GGUF weight is decoded)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    if hasattr(loaded, "materialize"):
        return loaded.materialize()
    raise ValueError(f"tensor parallelism cannot slice a {type(loaded).__name__} checkpoint tensor")


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """K/V heads each tensor-parallel rank holds: an equal share, or one replicated head when there are fewer K/V
    heads than ranks (vLLM's GQA rule); ValueError naming tensor_parallel_size when the heads do not split."""
    if num_heads % tp_size or (num_kv_heads % tp_size and tp_size % num_kv_heads):
        raise ValueError(f"tensor_parallel_size ({tp_size}) must divide the model's {num_heads} attention heads and "
                         f"divide or be a multiple of its {num_kv_heads} key/value heads.")
    return max(1, num_kv_heads // tp_size)


class QKVParallelLinear(LinearBase):
    """The fused Q/K/V projection (shards "q", "k", "v"; K/V heads may be fewer: GQA). With tensor parallelism each
    rank holds its query heads and the K/V heads they read (replicated when ranks outnumber K/V heads)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 ctx: LayerContext, checkpoint_prefixes: list[str]) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        kv_size = kv_heads_per_rank(num_heads, num_kv_heads, ctx.tp_size) * head_dim * ctx.tp_size
        sizes = [num_heads * head_dim, kv_size, kv_size]
        super().__init__(hidden_size, sizes, bias, ctx, [f"{p}.weight" for p in checkpoint_prefixes],
                         shard_ids=["q", "k", "v"])
        self.full_output_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def column_slice(self, loaded: torch.Tensor, index: int) -> torch.Tensor:
        """Query rows: an equal share; K/V rows: those of the heads this rank's query heads read."""
        if index == 0:
            return super().column_slice(loaded, index)
        first_head = self.tp_rank * self.num_kv_heads // self.tp_size
        return loaded.narrow(0, first_head * self.head_dim, self.output_sizes[index])

    def adjust_loaded(self, loaded: Any, shard_id: Any) -> Any:
        """Q/K rows that llama.cpp permuted for its interleaved RoPE, read back in HF order."""
        if getattr(loaded, "rope_permuted", False) and shard_id in ("q", "k"):
            return loaded.unpermute_rope(self.num_heads if shard_id == "q" else self.num_kv_heads)
        return loaded


class RowParallelLinear(LinearBase):
    """A linear whose input columns are split over tensor-parallel ranks; the partial outputs are summed."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: LayerContext, prefix: str) -> None:
        super().__init__(input_size, [output_size], bias, ctx, [f"{prefix}.weight"], split="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / tp] -> [T, out], summed over ranks."""
        out = self.quant_method.apply(self, x)
        if self.tp_size > 1:
            self.tp_group.all_reduce(out)
        return out

    def process_weights_after_loading(self) -> None:
        """As LinearBase; with one rank there is nothing to sum, so the module call goes straight to the method."""
        super().process_weights_after_loading()
        if self.tp_size == 1:
            self.forward = functools.partial(self.quant_method.apply, self)
