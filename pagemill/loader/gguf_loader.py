"""Read a GGUF file's tensors as (HF parameter name, float tensor) pairs, and keep Q4_1 / Q8_0 blocks as stored.

Q4_1, Q8_0, F16 and F32 tensors are decoded here with torch from the memory-mapped bytes, with the arithmetic of
`gguf.quants.dequantize` (Q4_1: (d * q) + m, Q8_0: q * d, in float32, each product and sum rounded once), so the
float32 weights are bit-identical to the ones transformers loads; other types go through `gguf.quants`. The raw
Q4_1 / Q8_0 blocks of the 2-D weights are kept (rows in HF order) so the GEMV packing can re-lay them out instead
of re-fitting the dequantized floats (`pagemill.layers.linear.pack_q4_1_blocks`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

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
_BLOCK_BYTES = {GGML_Q4_1: 4 + QK // 2, GGML_Q8_0: 2 + QK}
_CHUNK_ROWS = 4096  # rows decoded at a time: bounds the float temporaries of the 49152-row embedding


@dataclass
class GGUFBlocks:
    """A weight's Q4_1 or Q8_0 blocks as stored in the file: uint8 [rows, K / 32, bytes per block], HF row order."""

    ggml_type: int
    blocks: torch.Tensor

    @property
    def format(self) -> str:
        """q4_1 or q8_0."""
        return "q4_1" if self.ggml_type == GGML_Q4_1 else "q8_0"


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


def _row_permutation(gguf_name: str, hf_config) -> int | None:
    """The head count to un-permute this tensor's rows with (llama Q/K weights), else None."""
    if hf_config.model_type == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        return hf_config.num_attention_heads if ".attn_q." in gguf_name else hf_config.num_key_value_heads
    return None


def _raw_tensor(gguf: GGUFFile, t: GGUFTensor) -> torch.Tensor:
    """The tensor's bytes, uint8 [rows, bytes per row], viewing the (read-only) map: callers only read it."""
    with warnings.catch_warnings():  # torch warns that it cannot write to a read-only buffer; nothing writes
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(gguf.raw(t))


def dequantize_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r, :] = (d * q) + m over the Q4_1 blocks [rows, K/32, 20] (float32, like gguf.quants)."""
    rows, nb, _ = blocks.shape
    view = out.view(rows, nb, QK)
    for r0 in range(0, rows, _CHUNK_ROWS):
        b = blocks[r0:r0 + _CHUNK_ROWS]
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., 4:]
        dst = view[r0:r0 + _CHUNK_ROWS]
        q = torch.cat((qs & 15, qs >> 4), dim=-1)  # byte j: q[j] low nibble, q[j + 16] high nibble
        torch.mul(q, d, out=dst)  # uint8 * float32 -> float32, rounded once
        dst.add_(m)
    return out


def dequantize_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r, :] = q * d over the Q8_0 blocks [rows, K/32, 34] (float32, like gguf.quants)."""
    rows, nb, _ = blocks.shape
    view = out.view(rows, nb, QK)
    for r0 in range(0, rows, _CHUNK_ROWS):
        b = blocks[r0:r0 + _CHUNK_ROWS]
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        q = b[..., 2:].view(torch.int8)
        torch.mul(q, d, out=view[r0:r0 + _CHUNK_ROWS])
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


class GGUFWeights:
    """The tensors of a GGUF file under their HF names; `blocks` collects the Q4_1 / Q8_0 blocks met on the way."""

    def __init__(self, path: str, hf_config) -> None:
        self.gguf = open_gguf(path)
        self.hf_config = hf_config
        self.blocks: dict[str, GGUFBlocks] = {}  # HF name -> blocks (2-D Q4_1 / Q8_0 weights)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, float32 tensor) for every tensor the model uses."""
        model_type = self.hf_config.model_type
        for t in self.gguf.tensors.values():
            hf_name = gguf_to_hf_name(t.name, model_type)
            if hf_name is None:
                continue
            with single_threaded():
                tensor = self._load(t, hf_name)
            yield hf_name, tensor

    def _load(self, t: GGUFTensor, hf_name: str) -> torch.Tensor:
        heads = _row_permutation(t.name, self.hf_config)
        raw = _raw_tensor(self.gguf, t)
        if t.ggml_type in _BLOCK_BYTES and len(t.shape) == 2:
            blocks = raw.view(t.shape[0], t.shape[1] // QK, _BLOCK_BYTES[t.ggml_type])
            if heads is not None:
                blocks = _reverse_permute(blocks, heads)  # a copy (uint8), in HF row order
            self.blocks[hf_name] = GGUFBlocks(t.ggml_type, blocks)
            out = torch.empty(t.shape, dtype=torch.float32)
            if t.ggml_type == GGML_Q4_1:
                return dequantize_q4_1(blocks, out)
            return dequantize_q8_0(blocks, out)
        if t.ggml_type == GGML_F32:
            arr = raw.view(torch.float32).reshape(t.shape).clone()
        elif t.ggml_type == GGML_F16:
            arr = raw.view(torch.float16).reshape(t.shape).float()
        else:
            from gguf.quants import dequantize

            arr = torch.from_numpy(np.asarray(dequantize(raw.numpy(), t.ggml_type), dtype=np.float32).copy())
            arr = arr.reshape(t.shape)
        if heads is not None:
            arr = _reverse_permute(arr, heads).contiguous()
        if self.hf_config.model_type.startswith("gemma") and "norm" in t.name:
            arr = arr - 1.0  # GGUF stores Gemma's (1 + w) norm weights
        return arr


def iter_gguf_weights(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the GGUF file under its HF name, dequantized to float32."""
    yield from GGUFWeights(path, hf_config)
