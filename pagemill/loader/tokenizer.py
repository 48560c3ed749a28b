"""Load the tokenizer (and chat template) of a HF directory or a GGUF file."""

from __future__ import annotations

import os
from typing import Any

from pagemill.config.config_snapshot import config_class_name
from pagemill.loader.metadata_cache import cached_tokenizer


def load_tokenizer(tokenizer_path: str, gguf_file: str | None = None, hf_config: Any = None) -> Any:
    """A transformers fast tokenizer (built once per file version: `metadata_cache`); for GGUF it is built from the
    file's metadata.

    `tokenizer_path`: a HF tokenizer directory, or a .gguf file (the model's, `gguf_file`, or another one).
    """
    if tokenizer_path.endswith(".gguf") and os.path.isfile(tokenizer_path) and (
            gguf_file is None or os.path.abspath(tokenizer_path) != os.path.abspath(gguf_file)):
        gguf_file, hf_config = tokenizer_path, None  # another GGUF's tokenizer: its own config picks the class
    if gguf_file is not None and os.path.abspath(tokenizer_path) == os.path.abspath(gguf_file):
        return cached_tokenizer(gguf_file, lambda: _build_gguf_tokenizer(gguf_file, hf_config))
    if os.path.isdir(tokenizer_path):
        return cached_tokenizer(tokenizer_path, lambda: _auto_tokenizer(tokenizer_path))
    return _auto_tokenizer(tokenizer_path)


def _auto_tokenizer(path: str) -> Any:
    """transformers' AutoTokenizer for a HF tokenizer directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _build_gguf_tokenizer(gguf_file: str, hf_config: Any) -> Any:
    """The tokenizer transformers builds from a GGUF file's metadata."""
    from transformers import AutoTokenizer

    directory, name = os.path.dirname(gguf_file), os.path.basename(gguf_file)
    cls = _gguf_tokenizer_class(directory, gguf_file, hf_config)
    if cls is not None:
        return cls.from_pretrained(directory, gguf_file=name, _from_auto=True)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def _gguf_tokenizer_class(directory: str, gguf_file: str, hf_config: Any) -> type | None:
    """The class `AutoTokenizer.from_pretrained(directory, gguf_file=...)` picks, without its slow config read.

    AutoTokenizer first builds the model config from the GGUF with `gguf.GGUFReader` (~5 s for SmolLM2) only to
    choose the tokenizer class: with no tokenizer_config.json next to the file, that is the class registered for
    the config's type (TokenizersBackend when none is). The tokenizer itself is then built from the GGUF metadata
    by that class either way. None (use AutoTokenizer) in the cases it decides otherwise.
    """
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if os.path.exists(os.path.join(directory, "tokenizer_config.json")):
        return None
    if hf_config is None:
        from pagemill.loader.model_files import gguf_hf_config

        hf_config = gguf_hf_config(gguf_file)
    if getattr(hf_config, "tokenizer_class", None):
        return None
    cls = registered_tokenizer_class(config_class_name(hf_config)) or TokenizersBackend
    if cls.__name__ in ("MistralCommonBackend", "PythonBackend"):
        return None
    return cls


def registered_tokenizer_class(config_class: str) -> type | None:
    """`TOKENIZER_MAPPING.get(<config class>)` by the class's name: transformers' lookup without importing the
    config class (a config snapshot has none)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    model_types = [t for t, name in CONFIG_MAPPING_NAMES.items() if name == config_class]
    # the lazy mapping's reverse lookup (the last model type naming the class), then any other that has one
    for model_type in model_types[-1:] + model_types:
        if model_type in TOKENIZER_MAPPING_NAMES:
            name = TOKENIZER_MAPPING_NAMES[model_type]
            return tokenizer_class_from_name(name) if name else None
    return None


SKIP_TOKENIZER_MESSAGE = ("the engine runs with skip_tokenizer_init (--skip-tokenizer-init): it has no tokenizer, "
                          "so prompts must be token ids and outputs are token ids")


class NoTokenizer:
    """The tokenizer of an engine started with skip_tokenizer_init (vLLM's token-in / token-out mode): it knows the
    end-of-sequence id from the model's config; anything that needs text raises a ValueError saying why."""

    is_stub = True
    chat_template = None
    init_kwargs: dict[str, Any] = {}
    all_special_ids: list[int] = []
    all_special_tokens: list[str] = []

    def __init__(self, hf_config: Any = None, model_dir: str | None = None) -> None:
        eos = getattr(hf_config, "eos_token_id", None)
        if eos is None and model_dir is not None:
            import json

            try:
                with open(os.path.join(model_dir, "generation_config.json")) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                eos = None
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        self.bos_token_id = getattr(hf_config, "bos_token_id", None)
        self.pad_token_id = getattr(hf_config, "pad_token_id", None)
        self.vocab_size = getattr(hf_config, "vocab_size", 0)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {}

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"prompt: {SKIP_TOKENIZER_MESSAGE}.")

    encode = decode = batch_decode = apply_chat_template = convert_ids_to_tokens = convert_tokens_to_ids = _refuse
    convert_tokens_to_string = tokenize = __call__ = _refuse


def is_no_tokenizer(tokenizer: Any) -> bool:
    """Whether `tokenizer` is the NoTokenizer of skip_tokenizer_init."""
    return getattr(tokenizer, "is_stub", False) is True


def load_engine_tokenizer(model_config: Any) -> Any:
    """The tokenizer of a ModelConfig: NoTokenizer with skip_tokenizer_init, else load_tokenizer's."""
    if getattr(model_config, "skip_tokenizer_init", False):
        directory = model_config.model if os.path.isdir(model_config.model) else None
        return NoTokenizer(model_config.hf_config, directory)
    return load_tokenizer(model_config.tokenizer, model_config.gguf_file, model_config.hf_config)
