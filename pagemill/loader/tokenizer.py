"""Load the tokenizer (and chat template) of a HF directory or a GGUF file."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(tokenizer_path: str, gguf_file: str | None = None, hf_config: Any = None) -> Any:
    """A transformers fast tokenizer; for GGUF it is built from the file's metadata.

    `tokenizer_path`: a HF tokenizer directory, or a .gguf file (the model's, `gguf_file`, or another one).
    """
    from transformers import AutoTokenizer

    if tokenizer_path.endswith(".gguf") and os.path.isfile(tokenizer_path) and (
            gguf_file is None or os.path.abspath(tokenizer_path) != os.path.abspath(gguf_file)):
        gguf_file, hf_config = tokenizer_path, None  # another GGUF's tokenizer: its own config picks the class
    if gguf_file is not None and os.path.abspath(tokenizer_path) == os.path.abspath(gguf_file):
        directory, name = os.path.dirname(gguf_file), os.path.basename(gguf_file)
        cls = _gguf_tokenizer_class(directory, gguf_file, hf_config)
        if cls is not None:
            return cls.from_pretrained(directory, gguf_file=name, _from_auto=True)
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return AutoTokenizer.from_pretrained(tokenizer_path)


def _gguf_tokenizer_class(directory: str, gguf_file: str, hf_config: Any) -> type | None:
    """The class `AutoTokenizer.from_pretrained(directory, gguf_file=...)` picks, without its slow config read.

    AutoTokenizer first builds the model config from the GGUF with `gguf.GGUFReader` (~5 s for SmolLM2) only to
    choose the tokenizer class: with no tokenizer_config.json next to the file, that is the class registered for
    the config's type (TokenizersBackend when none is). The tokenizer itself is then built from the GGUF metadata
    by that class either way. None (use AutoTokenizer) in the cases it decides otherwise.
    """
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if os.path.exists(os.path.join(directory, "tokenizer_config.json")):
        return None
    if hf_config is None:
        from pagemill.loader.model_files import gguf_hf_config

        hf_config = gguf_hf_config(gguf_file)
    if getattr(hf_config, "tokenizer_class", None):
        return None
    cls = TOKENIZER_MAPPING.get(type(hf_config), TokenizersBackend) or TokenizersBackend
    if cls.__name__ in ("MistralCommonBackend", "PythonBackend"):
        return None
    return cls
