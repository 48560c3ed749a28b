"""The model's own sampling defaults (generation_config.json), as vLLM's `generation_config="auto"` reads them."""

from __future__ import annotations

import json
import os
from typing import Any

# generation_config.json key -> SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_path: str) -> dict[str, Any]:
    """SamplingParams overrides from the model directory's generation_config.json (empty without one, e.g. for a
    GGUF file). As in vLLM, a config that does not sample (`do_sample` false) contributes no temperature etc."""
    directory = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {field: config[key] for key, field in _FIELDS.items() if config.get(key) is not None}
