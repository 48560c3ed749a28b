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


class GGUFBlocks:
    """A weight's Q4_1 or Q8_0 blocks as stored in the file: uint8 [rows, K / 32, bytes per block], HF row order.

    A fused weight (q/k/v, gate/up) is several parts, concatenated in row order only when `blocks` is read (by the
    packing, which frees it right after). `release()` says the blocks were consumed: the file pages they were
    read from leave the process's resident set (they stay in the page cache).
    """

    def __init__(self, ggml_type: int, *parts: torch.Tensor, file_ranges: tuple = (), gguf: GGUFFile | None = None):
        self.ggml_type, self.parts = ggml_type, parts
        self._file_ranges, self._gguf = file_ranges, gguf

    @property
    def format(self) -> str:
        """q4_1 or q8_0."""
        return "q4_1" if self.ggml_type == GGML_Q4_1 else "q8_0"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, K / 32, bytes per block)."""
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])

    @property
    def blocks(self) -> torch.Tensor:
        """All rows' blocks, one tensor (a concatenation for a fused weight)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)

    def fuse(self, *others: GGUFBlocks) -> GGUFBlocks:
        """These blocks followed by others' rows (same type)."""
        return GGUFBlocks(self.ggml_type, *self.parts, *(p for o in others for p in o.parts),
                          file_ranges=self._file_ranges + tuple(r for o in others for r in o._file_ranges),
                          gguf=self._gguf)

    def release(self) -> None:
        """Done with the blocks: drop the mapping of their file pages from this process."""
        if self._gguf is not None:
            for offset, nbytes in self._file_ranges:
                self._gguf.release_pages(offset, nbytes)


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
    tensor (a model parameter, or a slice of a fused one) with no temporary copy for Q4_1 / Q8_0 / F32 / F16."""

    def __init__(self, owner: GGUFWeights, tensor: GGUFTensor, hf_name: str) -> None:
        self.owner, self.tensor, self.hf_name = owner, tensor, hf_name
        self.shape = torch.Size(tensor.shape)

    def materialize(self) -> torch.Tensor:
        """The tensor as a new float32 tensor."""
        return self.load_into(torch.empty(self.shape, dtype=torch.float32))

    def load_into(self, out: torch.Tensor) -> torch.Tensor:
        """Decode into `out` (float32, contiguous, this shape); also records the Q4_1 / Q8_0 blocks."""
        t, cfg = self.tensor, self.owner.hf_config
        if out.dtype != torch.float32 or out.shape != self.shape or not out.is_contiguous():
            raise ValueError(f"{self.hf_name}: cannot decode into a {out.dtype} {tuple(out.shape)} tensor")
        heads = _row_permutation(t.name, cfg)
        raw = _raw_tensor(self.owner.gguf, t)
        with single_threaded(), torch.no_grad():
            if t.ggml_type in _BLOCK_BYTES and len(t.shape) == 2:
                blocks = raw.view(t.shape[0], t.shape[1] // QK, _BLOCK_BYTES[t.ggml_type])
                if heads is not None:
                    blocks = _reverse_permute(blocks, heads)  # a copy (uint8), in HF row order
                self.owner.blocks[self.hf_name] = GGUFBlocks(t.ggml_type, blocks, file_ranges=((t.offset, t.nbytes),),
                                                             gguf=self.owner.gguf)
                return (dequantize_q4_1 if t.ggml_type == GGML_Q4_1 else dequantize_q8_0)(blocks, out)
            if t.ggml_type == GGML_F32:
                arr = raw.view(torch.float32).reshape(t.shape)
            elif t.ggml_type == GGML_F16:
                arr = raw.view(torch.float16).reshape(t.shape)
            else:
                from gguf.quants import dequantize

                arr = torch.from_numpy(np.asarray(dequantize(raw.numpy(), t.ggml_type), dtype=np.float32))
                arr = arr.reshape(t.shape)
            if heads is not None:
                arr = _reverse_permute(arr, heads)
            if cfg.model_type.startswith("gemma") and "norm" in t.name:
                arr = arr.float() - 1.0  # GGUF stores Gemma's (1 + w) norm weights
            return out.copy_(arr)


class GGUFWeights:
    """The tensors of a GGUF file under their HF names; `blocks` collects the Q4_1 / Q8_0 blocks met on the way."""

    def __init__(self, path: str, hf_config) -> None:
        self.gguf = open_gguf(path)
        self.hf_config = hf_config
        self.blocks: dict[str, GGUFBlocks] = {}  # HF name -> blocks (2-D Q4_1 / Q8_0 weights)

    def lazy(self) -> Iterator[tuple[str, GGUFWeight]]:
        """(HF name, GGUFWeight) for every tensor the model uses, nothing decoded yet."""
        model_type = self.hf_config.model_type
        for t in self.gguf.tensors.values():
            hf_name = gguf_to_hf_name(t.name, model_type)
            if hf_name is not None:
                yield hf_name, GGUFWeight(self, t, hf_name)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every tensor the model uses."""
        for hf_name, weight in self.lazy():
            yield hf_name, weight.materialize()


def iter_gguf_weights(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the GGUF file under its HF name, dequantized to float32."""
    yield from GGUFWeights(path, hf_config)
