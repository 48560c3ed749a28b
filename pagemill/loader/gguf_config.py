"""transformers' config dict for a GGUF file, from metadata we parsed ourselves.

This is `transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(path)["config"]` (what
`AutoConfig.from_pretrained(dir, gguf_file=...)` builds the config from) with the same key mapping tables, minus
its `GGUFReader` pass over the whole file. The architectures it treats specially return None (the caller then
asks transformers); tests/loader checks the result equals transformers' config for our models.
"""

from __future__ import annotations

from typing import Any

from pagemill.loader.gguf_file import GGUFFile

# Architectures for which load_gguf_checkpoint (or AutoConfig) does more than map keys.
_SPECIAL = ("t5", "stablelm", "qwen2moe", "qwen3moe", "gpt_oss", "gpt-oss", "minimax-m2", "lfm2", "gemma4")
_TIED_EXCEPTIONS = ("falcon", "bloom")  # transformers marks these tied whatever the tensors say


def gguf_config_dict(gguf: GGUFFile) -> dict[str, Any] | None:
    """The config dict transformers would build for this file, or None where it special-cases the architecture."""
    try:
        from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:  # another transformers layout: let AutoConfig do it
        return None
    md = gguf.metadata
    architecture = md["general.architecture"]
    if any(s in architecture for s in _SPECIAL) or architecture in GGUF_CONFIG_ARCHS:
        return None
    model_name = [md["general.name"]] if "general.name" in md else []
    # transformers: llama.cpp files of Mistral models say "llama" (it tests list membership, as here).
    updated = "mistral" if "llama" in architecture and "mistral" in model_name else architecture
    if architecture not in GGUF_CONFIG_MAPPING and updated not in GGUF_CONFIG_MAPPING:
        return None  # unsupported: AutoConfig raises its own error

    config: dict[str, Any] = {
        "tie_word_embeddings": "output.weight" not in gguf.tensors or architecture in _TIED_EXCEPTIONS,
    }
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in md.items():
        key = key.replace(architecture, updated)
        prefix, _, config_key = key.partition(".")
        names = GGUF_CONFIG_MAPPING.get(prefix)
        if not names or config_key not in names:
            continue
        renamed = names[config_key]
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, list) and len(value) == 1:  # transformers unwraps one-element arrays
            value = value[0]
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        config[renamed] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"  # the GGUF holds the text backbone only
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in md:
        config["vocab_size"] = len(md["tokenizer.ggml.tokens"])
    if config.get("model_type") == "mistral" and "layer_types" in config:
        config["model_type"] = "ministral"  # AutoConfig's heuristic
    return config
