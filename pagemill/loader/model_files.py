"""Find a model's files (HF directory or GGUF file) and load its HF config."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

from pagemill.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagemill.loader.metadata_cache import cached_config


@dataclass
class ResolvedModel:
    """Where a model's weights, config and tokenizer live."""

    path: str  # the directory, or the .gguf file
    tokenizer_path: str
    gguf_file: str | None
    hf_config: Any
    display_name: str


def gguf_hf_config(path: str) -> Any:
    """The config of a GGUF file: a ConfigSnapshot of the transformers config, saved once so that a second start
    builds none (`metadata_cache`)."""
    return cached_config(path, lambda: _build_gguf_hf_config(path))


def _build_hf_config(directory: str) -> Any:
    """The transformers config of a HF model directory."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def _build_gguf_hf_config(path: str) -> Any:
    """The transformers config of a GGUF file, built from its metadata as `AutoConfig` builds it.

    transformers reads the whole file with `gguf.GGUFReader` for it (~5 s for SmolLM2); this reads the metadata
    parsed once per process (`open_gguf`) and applies transformers' own key mapping. Architectures transformers
    special-cases (MoE, T5, StableLM, Gemma 4, LFM2, GPT-OSS, ...) still go through `AutoConfig`.
    """
    from pagemill.loader.gguf_config import gguf_config_dict
    from pagemill.loader.gguf_file import open_gguf

    config_dict = gguf_config_dict(open_gguf(path))
    if config_dict is None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)


def resolve_model(model: str | None, tokenizer: str | None = None) -> ResolvedModel:
    """Resolve `model` (None = embedded default, a HF directory, or a .gguf file) and load its config."""
    display = model
    if model is None:
        model, display = default_model_path(), DEFAULT_MODEL_NAME
    model = os.path.expanduser(model)
    if not os.path.exists(model):
        raise ValueError(
            f"model {model!r} does not exist: give a Hugging Face model directory or a .gguf file "
            "(models are never downloaded)."
        )
    gguf_file = None
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(model, "*.gguf")))
        if len(ggufs) != 1:
            raise ValueError(f"model directory {model!r} has no config.json and not exactly one .gguf file.")
        model = ggufs[0]
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file.")
        gguf_file = model
        hf_config = gguf_hf_config(model)
    else:
        hf_config = cached_config(os.path.join(model, "config.json"), lambda: _build_hf_config(model))
    return ResolvedModel(model, _tokenizer_path(tokenizer) or model, gguf_file, hf_config, display or model)


def _tokenizer_path(tokenizer: str | None) -> str | None:
    """A `tokenizer` argument checked: a local HF tokenizer directory or a .gguf file (None: the model's)."""
    if tokenizer is None:
        return None
    path = os.path.expanduser(tokenizer)
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"tokenizer directory {tokenizer!r} has neither tokenizer.json nor tokenizer_config.json.")
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    raise ValueError(f"tokenizer {tokenizer!r} does not exist: give a local Hugging Face tokenizer directory or a "
                     ".gguf file (tokenizers are never downloaded).")
