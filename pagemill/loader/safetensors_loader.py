"""Read a Hugging Face directory's weights (safetensors, or pytorch .bin as a fallback)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch


def iter_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor stored in the directory."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
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
