"""The per-device layer-ops tables: `TorchLayerOps` (pure torch, HF's math: the reference), `KernelLayerOps` (the
compiled CPU kernels) and `TritonLayerOps` (kernels/triton_ops.py, the CUDA platform's). The platform names the
tables each attention backend gets (`Platform.layer_ops`, import paths tried in order), `select_layer_ops` builds the
first whose kernels are available here, and the runner builds its layers with it: a layer binds the table once at
init and calls its methods (no per-call lookup in a registry), and engines with different tables live side by side
in one process.

`out_dtype` is the dtype the consumer (usually the next matmul) reads, so the cast is fused into the op.

The linear ops the quantization methods, the quantized embedding, the greedy head screen and the sampler's bitmask
need (`LINEAR_KERNELS`: GEMV over GGUF records / int8 tiles / packed fp16 and fp32 weights, their packers, GGUF row
decoding, the head screen) exist only as compiled kernels: `KernelLayerOps` binds the module's functions themselves
as instance attributes (no Python frame, no lookup per call: the decode path calls the pybind function directly),
the other tables raise a ValueError naming the op (`linear_kernels` False: the quant configs check it first).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import torch
import torch.nn.functional as F

from pagemill.kernels.build import load_kernels
from pagemill.platforms import current_platform
from pagemill.utils.import_utils import resolve_obj_by_qualname

if TYPE_CHECKING:
    from pagemill.platforms.interface import Platform

# The compiled-only ops a table exposes by name (KernelLayerOps binds each to the module's function).
LINEAR_KERNELS = ("gemv_records", "gemv_int8", "gemv_f16", "gemv_bf16", "gemv_f32", "pack_gemv_weight_f16",
                  "pack_gemv_weight_q4", "gguf_rows", "pack_head_screen", "head_screen",
                  "apply_token_bitmask")


def _needs_kernels(op: str) -> NoReturn:
    raise ValueError(f"{op} runs in pagemill's compiled CPU kernels, which this engine's layer ops do not have "
                     "(attention_backend='torch' or 'triton', or the kernels are not built: `pagemill env` says why).")


class TorchLayerOps:
    """The reference: each op in plain torch, computed as HF transformers computes it."""

    kernels: ModuleType | None = None  # the compiled module behind the ops (none here)
    fused_rotary: ClassVar[bool] = False  # whether the table has `rotary` (RoPE of q and k in one kernel)
    linear_kernels: ClassVar[bool] = False  # whether the LINEAR_KERNELS ops run (the quantized linear methods' need)

    @classmethod
    def create(cls) -> TorchLayerOps | None:
        """The table when its kernels are available in this process, else None (the platform's next choice)."""
        return cls()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        """weight * x / rms(x), computed in float32, returned in `out_dtype`."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * h.to(x.dtype)).to(out_dtype)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        residual = residual + x.to(residual.dtype)
        return self.rms_norm(residual, weight, eps, out_dtype), residual

    def silu_and_mul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """silu(gate) * up for x = [gate | up] along the last dim, in `out_dtype`."""
        gate, up = x.chunk(2, dim=-1)
        return (F.silu(gate) * up).to(out_dtype)

    def gelu_tanh_and_mul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """gelu_tanh(gate) * up for x = [gate | up] (Gemma's gated MLP), in `out_dtype`."""
        gate, up = x.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") * up).to(out_dtype)

    def lora_delta(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   runs: torch.Tensor) -> None:
        """y[a:b] += (x[a:b] @ lora_a[s]) @ lora_b[s] for each row (a, b, s) of `runs` (int32 [R, 3]), in place:
        two matmuls per run."""
        x = x.to(lora_a.dtype)
        for a, b, s in runs.tolist():
            y[a:b].addmm_(torch.mm(x[a:b], lora_a[s]), lora_b[s])

    # The linear ops below are compiled-only: here they raise (KernelLayerOps binds the kernels' functions).
    def has_kernel(self, op: str) -> bool:
        """Whether the compiled op `op` (one of LINEAR_KERNELS) runs with this table."""
        return False

    def isa(self) -> str:
        """The active kernel variant ("" without compiled kernels)."""
        return ""

    def gemv_records(self, out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, format: str,
                     bias: torch.Tensor | None = None, direct_only: bool = False,
                     int8_activations: bool = False) -> None:
        """out = x @ W^T + bias over GGUF bit-plane records `packed` of kind `format` (gguf_records.py)."""
        _needs_kernels("gemv_records")

    def gemv_int8(self, out: torch.Tensor, x: torch.Tensor, packed_q: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None, mins: torch.Tensor | None = None, direct_only: bool = False,
                  int8_activations: bool = False) -> None:
        """out = x @ W^T + bias over int8 tiles (q, scales, optional mins)."""
        _needs_kernels("gemv_int8")

    def gemv_f16(self, out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None = None, direct_only: bool = False) -> None:
        """out = x @ W^T + bias over fp16 tiles [ceil(N / 64), K, 64] (pack_gemv_weight_f16), widened to float32."""
        _needs_kernels("gemv_f16")

    def gemv_bf16(self, out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None, direct_only: bool = False) -> None:
        """gemv_f16 over bf16 tiles."""
        _needs_kernels("gemv_bf16")

    def gemv_f32(self, out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        """out = x @ W^T + bias in a fixed reduction order (the batch-invariant dense path), W float32 tiles."""
        _needs_kernels("gemv_f32")

    def pack_gemv_weight_f16(self, w: torch.Tensor) -> torch.Tensor:
        """A [N, K] weight packed for gemv_f16."""
        _needs_kernels("pack_gemv_weight_f16")

    def pack_gemv_weight_q4(self, w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, Any]:
        """(Q4_1 records of a float [N, K] weight for gemv_records' q4 kind, the fit's relative max error)."""
        _needs_kernels("pack_gemv_weight_q4")

    def gguf_rows(self, out: torch.Tensor, blocks: torch.Tensor, ggml_type: int, ids: torch.Tensor) -> None:
        """out[i] = row ids[i] of a GGUF block-quantized matrix, decoded to float32."""
        _needs_kernels("gguf_rows")

    def pack_head_screen(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int8 screen of an LM head [N, K]: (q, scales, offsets, bounds: each channel's |w - w~| and |w~|)."""
        _needs_kernels("pack_head_screen")

    def head_screen(self, logits: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                    offsets: torch.Tensor, table: torch.Tensor, bounds: torch.Tensor,
                    argmax: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
                    mask_rows: torch.Tensor | None = None, table_ggml_type: int = 0) -> int:
        """Greedy-exact LM head logits (int8 screen, exact float32 recheck); returns the logits recomputed."""
        _needs_kernels("head_screen")

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """logits[rows[r], t] = -inf where bit t of bitmask[r] is 0, in place."""
        _needs_kernels("apply_token_bitmask")

    def decoder_graph(self, hidden: int, eps: float, activation: str, sandwich: bool, final_norm: torch.Tensor,
                      max_rows: int) -> Any:
        """An empty compiled decoder graph (csrc/cpu/decoder_graph.cpp): layers are recorded into it, then it runs a
        step's decoder stack in one call (worker/cpu_decoder_graph.py)."""
        _needs_kernels("decoder_graph")


class KernelLayerOps(TorchLayerOps):
    """The compiled kernels for the float32-weight ops they implement; the reference math for the rest."""

    linear_kernels: ClassVar[bool] = True

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        # The module's own functions as attributes: a call through the table is the pybind call, no extra frame.
        self.isa = kernels.isa
        for op in LINEAR_KERNELS:
            if hasattr(kernels, op):
                setattr(self, op, getattr(kernels, op))

    def has_kernel(self, op: str) -> bool:
        """Whether the compiled module has `op` (one of LINEAR_KERNELS)."""
        return hasattr(self.kernels, op)

    def decoder_graph(self, hidden: int, eps: float, activation: str, sandwich: bool, final_norm: torch.Tensor,
                      max_rows: int) -> Any:
        """An empty compiled decoder graph (the module's DecoderGraph)."""
        return self.kernels.DecoderGraph(hidden, eps, activation, sandwich, final_norm, max_rows)

    @classmethod
    def create(cls) -> KernelLayerOps | None:
        """The compiled kernels' table, or None when they are not built (one warning)."""
        kernels = load_kernels()
        return cls(kernels) if kernels is not None else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        """weight * x / rms(x), computed in float32, returned in `out_dtype`."""
        if weight.dtype != torch.float32:
            return super().rms_norm(x, weight, eps, out_dtype)
        out = torch.empty(x.shape, dtype=out_dtype)
        self.kernels.rms_norm(out, x.contiguous(), weight, eps)
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); the kernel updates `residual` in place."""
        if residual.dtype != torch.float32 or weight.dtype != torch.float32:
            return super().fused_add_rms_norm(x, residual, weight, eps, out_dtype)
        out = torch.empty(x.shape, dtype=out_dtype)
        self.kernels.fused_add_rms_norm(out, x.contiguous(), residual, weight, eps)
        return out, residual

    def silu_and_mul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """silu(gate) * up for x = [gate | up] along the last dim, in `out_dtype`."""
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=out_dtype)
        self.kernels.silu_and_mul(out, x.contiguous())
        return out

    def gelu_tanh_and_mul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """gelu_tanh(gate) * up for x = [gate | up] (Gemma's gated MLP), in `out_dtype`."""
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=out_dtype)
        self.kernels.gelu_tanh_and_mul(out, x.contiguous())
        return out

    def lora_delta(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   runs: torch.Tensor) -> None:
        """y[a:b] += (x[a:b] @ lora_a[s]) @ lora_b[s] for each row (a, b, s) of `runs`, in place: one kernel call
        for all runs (float32 slots and output; others take the reference path)."""
        if lora_a.dtype != torch.float32 or y.dtype != torch.float32 or not y.is_contiguous():
            return super().lora_delta(y, x, lora_a, lora_b, runs)
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        self.kernels.lora_delta(y, x.contiguous(), lora_a, lora_b, runs)


def select_layer_ops(attn_backend: str, platform: Platform | type[Platform] | None = None) -> TorchLayerOps:
    """The layer ops that go with the attention backend named `attn_backend` on `platform` (a platform or its class;
    default: this process's): the first of the platform's choices whose kernels are available, else the torch
    reference."""
    platform = platform or current_platform
    for path in platform.get_layer_ops_cls(attn_backend):
        ops = resolve_obj_by_qualname(path).create()
        if ops is not None:
            return ops
    return TorchLayerOps()
