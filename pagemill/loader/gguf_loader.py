"""Read a GGUF file's tensors as (HF parameter name, float tensor) pairs, and keep quantized blocks as stored.

Q4_1, Q8_0, F16 and F32 tensors are decoded here with torch from the memory-mapped bytes, with the arithmetic of
`gguf.quants.dequantize` (Q4_1: (d * q) + m, Q8_0: q * d, in float32, each product and sum rounded once), so the
float32 weights are bit-identical to the ones transformers loads; other types go through `gguf.quants`. Layers
that keep weights as stored (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS: `gguf_records.RECORD_TYPES`) read their
blocks (`GGUFWeight.blocks`) instead (`pagemill.layers.quantization.gguf`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagemill.layers.quantization.gguf_records import RECORD_TYPES
from pagemill.layers.quantization.half_tiles import GGUF_FLOAT_DTYPES
from pagemill.loader.gguf_file import GGML_F16, GGML_F32, GGML_Q4_1, GGML_Q8_0, GGUFFile, GGUFTensor, open_gguf

# GGUF tensor name (inside blk.N.) -> HF parameter name (inside model.layers.N.)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")

QK = 32  # elements per Q4_1 / Q8_0 block
_CHUNK_ROWS = 4096  # rows decoded at a time: bounds the float temporaries of the 49152-row embedding


def gguf_to_hf_name(name: str, model_type: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None if we do not use it."""
    m = _LAYER_RE.match(name)
    if m:
        layer, base, kind = m.groups()
        if model_type.startswith("gemma") and base == "ffn_norm":
            base_name = "pre_feedforward_layernorm"
        else:
            base_name = _LAYER_NAMES.get(base)
        return f"model.layers.{layer}.{base_name}.{kind}" if base_name else None
    base, _, kind = name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return f"{hf}.{kind}" if hf else None


def _reverse_permute(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (it interleaves the two RoPE halves); rows are the first axis."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _rope_permuted(gguf_name: str, model_type: str) -> bool:
    """True for the Q/K weights llama.cpp's converter permuted (llama: it interleaves the two RoPE halves)."""
    return model_type == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name)


def _raw_tensor(gguf: GGUFFile, t: GGUFTensor) -> torch.Tensor:
    """The tensor's bytes, uint8 [rows, bytes per row], viewing the (read-only) map: callers only read it."""
    with warnings.catch_warnings():  # torch warns that it cannot write to a read-only buffer; nothing writes
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(gguf.raw(t))


def dequantize_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r, :] = (d * q) + m over the Q4_1 blocks [rows, K/32, 20] (float32, like gguf.quants).

    The codes are converted into `out` itself and scaled in place: no float temporary the size of the tensor.
    """
    rows, nb, _ = blocks.shape
    view = out.view(rows, nb, QK)
    for r0 in range(0, rows, _CHUNK_ROWS):
        b = blocks[r0:r0 + _CHUNK_ROWS]
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., 4:]
        dst = view[r0:r0 + _CHUNK_ROWS]
        dst[..., :QK // 2].copy_(qs & 15)  # byte j: q[j] in the low nibble, q[j + 16] in the high one
        dst[..., QK // 2:].copy_(qs >> 4)
        dst.mul_(d).add_(m)  # each rounded once, as numpy's (d * q) + m
    return out


def dequantize_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r, :] = q * d over the Q8_0 blocks [rows, K/32, 34] (float32, like gguf.quants)."""
    rows, nb, _ = blocks.shape
    view = out.view(rows, nb, QK)
    for r0 in range(0, rows, _CHUNK_ROWS):
        b = blocks[r0:r0 + _CHUNK_ROWS]
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        dst = view[r0:r0 + _CHUNK_ROWS]
        dst.copy_(b[..., 2:].view(torch.int8))
        dst.mul_(d)
    return out


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch ops on one thread: the decode's ops are small (~1M elements), and on a machine whose other core
    is busy a 2-thread OpenMP region waits for it on every op (measured 20x slower with a build running)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class GGUFWeight:
    """One tensor of the file under its HF name, decoded when asked: `load_into(out)` writes it into a float32
    tensor (a model parameter, or a slice of one) with no temporary copy for Q4_1 / Q8_0 / F32 / F16; `blocks`
    are a block-quantized weight's blocks as stored (`format` names it), for layers that keep them.

    `rope_permuted`: the rows are in llama.cpp's interleaved-RoPE order; the layer that owns the rows calls
    `unpermute_rope(heads)` for a view in HF order.
    """

    def __init__(self, gguf: GGUFFile, tensor: GGUFTensor, hf_name: str, model_type: str,
                 rope_heads: int | None = None) -> None:
        self.gguf, self.tensor, self.hf_name, self.model_type = gguf, tensor, hf_name, model_type
        self.shape = torch.Size(tensor.shape)
        self.rope_heads = rope_heads  # set: rows are un-permuted for this many heads when read
        self.rope_permuted = rope_heads is None and _rope_permuted(tensor.name, model_type)

    @property
    def format(self) -> str | None:
        """The block format (q4_0, q4_1, q5_0, ..., q6_k) of a 2-D weight the records methods can keep, else None."""
        t = self.tensor
        if len(t.shape) != 2 or t.ggml_type not in RECORD_TYPES:
            return None
        return RECORD_TYPES[t.ggml_type][0]

    def unpermute_rope(self, heads: int) -> GGUFWeight:
        """This tensor with its rows read in HF order (undoing llama.cpp's Q/K permutation for `heads` heads)."""
        return GGUFWeight(self.gguf, self.tensor, self.hf_name, self.model_type, rope_heads=heads)

    @cached_property
    def blocks(self) -> torch.Tensor:
        """uint8 [rows, K / block length, bytes per block]: a view of the file map (a copy, made once, when rows are
        un-permuted)."""
        t = self.tensor
        length, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        blocks = _raw_tensor(self.gguf, t).view(t.shape[0], t.shape[1] // length, nbytes)
        return blocks if self.rope_heads is None else _reverse_permute(blocks, self.rope_heads)

    def stored_values(self) -> torch.Tensor:
        """A float tensor's values in their stored dtype (F32, F16, BF16), in HF row order: a view of the file map
        (a copy when rows are un-permuted)."""
        t = self.tensor
        if t.ggml_type not in GGUF_FLOAT_DTYPES:
            raise ValueError(f"{self.hf_name}: ggml type {t.ggml_type} is not a float type")
        arr = _raw_tensor(self.gguf, t).view(GGUF_FLOAT_DTYPES[t.ggml_type]).reshape(t.shape)
        return arr if self.rope_heads is None else _reverse_permute(arr, self.rope_heads)

    def materialize(self) -> torch.Tensor:
        """The tensor as a new float32 tensor."""
        return self.load_into(torch.empty(self.shape, dtype=torch.float32))

    def load_into(self, out: torch.Tensor) -> torch.Tensor:
        """Decode into `out` (float32, contiguous, this shape)."""
        t = self.tensor
        if out.dtype != torch.float32 or out.shape != self.shape or not out.is_contiguous():
            raise ValueError(f"{self.hf_name}: cannot decode into a {out.dtype} {tuple(out.shape)} tensor")
        with single_threaded(), torch.no_grad():
            if t.ggml_type in (GGML_Q4_1, GGML_Q8_0) and len(t.shape) == 2:
                return (dequantize_q4_1 if t.ggml_type == GGML_Q4_1 else dequantize_q8_0)(self.blocks, out)
            raw = _raw_tensor(self.gguf, t)
            if t.ggml_type == GGML_F32:
                arr = raw.view(torch.float32).reshape(t.shape)
            elif t.ggml_type == GGML_F16:
                arr = raw.view(torch.float16).reshape(t.shape)
            else:
                from gguf.quants import dequantize

                arr = torch.from_numpy(np.asarray(dequantize(raw.numpy(), t.ggml_type), dtype=np.float32))
                arr = arr.reshape(t.shape)
            if self.rope_heads is not None:
                arr = _reverse_permute(arr, self.rope_heads)
            if self.model_type.startswith("gemma") and "norm" in t.name:
                arr = arr.float() - 1.0  # GGUF stores Gemma's (1 + w) norm weights
            return out.copy_(arr)

    def release(self) -> None:
        """Done with this tensor: its file pages leave the process's resident set (they stay in the page cache)."""
        self.gguf.release_pages(self.tensor.offset, self.tensor.nbytes)


class GGUFWeights:
    """The tensors of a GGUF file under their HF names."""

    def __init__(self, path: str, hf_config) -> None:
        self.gguf = open_gguf(path)
        self.hf_config = hf_config

    def lazy(self) -> Iterator[tuple[str, GGUFWeight]]:
        """(HF name, GGUFWeight) for every tensor the model uses, nothing decoded yet."""
        model_type = self.hf_config.model_type
        for t in self.gguf.tensors.values():
            hf_name = gguf_to_hf_name(t.name, model_type)
            if hf_name is not None:
                yield hf_name, GGUFWeight(self.gguf, t, hf_name, model_type)

    def tensor_types(self) -> dict[str, int]:
        """HF name -> ggml type, from the tensor table (the quantization config is chosen from it)."""
        return {name: w.tensor.ggml_type for name, w in self.lazy()}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor in HF row order) for every tensor the model uses."""
        for hf_name, weight in self.lazy():
            if weight.rope_permuted:
                heads = self.hf_config.num_attention_heads if ".q_proj." in hf_name else \
                    self.hf_config.num_key_value_heads
                weight = weight.unpermute_rope(heads)
            yield hf_name, weight.materialize()
