"""A GGUF file, parsed once: its metadata and tensor table, and its tensor bytes as views of one memory map.

`gguf.GGUFReader` builds a numpy memmap view for every part of every metadata field (the 49,152 tokens and
48,900 merges of SmolLM2 are ~440,000 of them: seconds), and transformers reads the file again for the config
and for the tokenizer. Here the header is walked once with `struct` (~0.1 s for SmolLM2) and the result is
shared by the config, the tokenizer (its type, special ids) and the weights of one process (`open_gguf`).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent

# Metadata value types (GGUF spec): fixed-size scalars by struct format; 8 = string, 9 = array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types: plain values (numpy dtype) and block formats (elements, bytes per block).
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30
_PLAIN = {GGML_F32: np.float32, GGML_F16: np.float16}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in the file: name, shape in torch order ([rows, cols]), ggml type, bytes."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """Metadata (`metadata`: key -> value; arrays as lists) and tensors (`tensors`: name -> GGUFTensor)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic).")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are supported.")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = _value(buf, pos + 4, vtype)
        self.metadata = metadata
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (ndim,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, ggml_type, offset in infos:
            nbytes = tensor_nbytes(ggml_type, shape)
            start = data_start + offset
            if start + nbytes > len(buf):
                raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated?).")
            self.tensors[name] = GGUFTensor(name, shape, ggml_type, start, nbytes)

    @property
    def architecture(self) -> str:
        """general.architecture (llama, qwen2, gemma3, ...)."""
        return str(self.metadata["general.architecture"])

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the map: [rows, bytes per row] (2-D tensors)."""
        flat = np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)
        rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
        return flat.reshape(rows, tensor.nbytes // rows)


    def release_pages(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Drop this process's mapping of the file's pages in [offset, offset + nbytes) (all by default): they stay
        in the page cache and a later read maps them again, but they no longer count in the resident set. The
        range is widened to whole pages (the map is read-only, so nothing is lost)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = len(self._map) if nbytes is None else min(len(self._map), offset + nbytes)
        start = offset - offset % mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and shape occupies in the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    count = int(np.prod(shape)) if shape else 1
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if shape and shape[-1] % block:
        raise ValueError(f"a ggml type {ggml_type} tensor's rows ({shape[-1]}) are not whole blocks of {block}.")
    return count // block * block_bytes


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return buf[pos:pos + n].decode("utf-8", errors="replace"), pos + n


def _value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALAR:
        fmt = "<" + _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALAR:
            fmt = f"<{count}{_SCALAR[etype]}"
            return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
        if etype == _STRING:
            out = []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
                pos += n
            return out, pos
        values = []
        for _ in range(count):
            v, pos = _value(buf, pos, etype)
            values.append(v)
        return values, pos
    raise ValueError(f"unknown GGUF metadata value type {vtype}")


@lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed file, shared within a process while the file is unchanged (same size and mtime)."""
    path = os.path.abspath(path)
    st = os.stat(path)
    return _open(path, st.st_size, st.st_mtime_ns)
