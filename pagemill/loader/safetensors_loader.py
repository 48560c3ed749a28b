"""Read a Hugging Face directory's weights (safetensors, or pytorch .bin as a fallback).

safetensors tensors view the file's map (torch storage from the file): pages are read when a layer reads them."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch


def safetensors_files(model_dir: str) -> list[str]:
    """The directory's *.safetensors weight files, sorted (empty for a .bin checkpoint)."""
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def iter_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor stored in the directory."""
    files = safetensors_files(model_dir)
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        return
    bins = sorted(glob.glob(os.path.join(model_dir, "*.bin")))
    if not bins:
        raise ValueError(f"model directory {model_dir!r} has no *.safetensors or *.bin weight files.")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def checkpoint_dtypes(model_dir: str) -> dict[str, torch.dtype]:
    """Name -> stored dtype (float32, float16, bfloat16; None for any other) of every tensor in the directory's
    safetensors files, from their headers (nothing is read beyond them); empty for a .bin checkpoint."""
    from safetensors import safe_open

    dtypes = {}
    for f in safetensors_files(model_dir):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                dtypes[name] = _SAFETENSORS_DTYPES.get(st.get_slice(name).get_dtype())
    return dtypes
