"""Model registry: HF architecture name or GGUF/HF model_type -> model class."""

from __future__ import annotations

from torch import nn

from pagemill.models.gemma3 import Gemma3ForCausalLM
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.mistral import MistralForCausalLM
from pagemill.models.mixtral import MixtralForCausalLM
from pagemill.models.phi3 import Phi3ForCausalLM
from pagemill.models.qwen2 import Qwen2ForCausalLM
from pagemill.models.qwen2_moe import Qwen2MoeForCausalLM
from pagemill.models.qwen3 import Qwen3ForCausalLM
from pagemill.models.qwen3_moe import Qwen3MoeForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
_MODEL_TYPES: dict[str, type[nn.Module]] = {
    "gemma3_text": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "mixtral": MixtralForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    """Names accepted by `get_model_class`."""
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config) -> type[nn.Module]:
    """The class implementing the config's architecture; a clear error naming it otherwise."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    name = archs[0] if archs else model_type
    raise ValueError(
        f"Model architecture {name!r} is not supported. Supported architectures: "
        f"{', '.join(supported_architectures())}."
    )
