"""Load the tokenizer (and chat template) of a HF directory or a GGUF file."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(tokenizer_path: str, gguf_file: str | None = None) -> Any:
    """A transformers fast tokenizer; for GGUF it is built from the file's metadata."""
    from transformers import AutoTokenizer

    if gguf_file is not None and os.path.abspath(tokenizer_path) == os.path.abspath(gguf_file):
        return AutoTokenizer.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    return AutoTokenizer.from_pretrained(tokenizer_path)
