"""Model registry: the supported families, by HF architecture name, HF model_type and GGUF `general.architecture`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pagemill.models.bert import BertForSequenceClassification, BertModel
from pagemill.models.gemma3 import Gemma3ForCausalLM
from pagemill.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagemill.models.idefics3 import Idefics3ForConditionalGeneration
from pagemill.models.llama import LlamaForCausalLM
from pagemill.models.llava import LlavaForConditionalGeneration
from pagemill.models.mistral import MistralForCausalLM
from pagemill.models.mixtral import MixtralForCausalLM
from pagemill.models.phi3 import Phi3ForCausalLM
from pagemill.models.qwen2 import Qwen2ForCausalLM
from pagemill.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from pagemill.models.qwen2_moe import Qwen2MoeForCausalLM
from pagemill.models.qwen3 import Qwen3ForCausalLM
from pagemill.models.qwen3_moe import Qwen3MoeForCausalLM


@dataclass(frozen=True)
class ModelFamily:
    """One supported family: its class and the names that select it (GGUF only where a GGUF of it is tested)."""

    name: str
    model_class: type[nn.Module]
    architecture: str  # HF `architectures[0]`
    model_type: str  # HF config model_type (also what a GGUF's config maps to)
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture values run and tested from a GGUF file


MODEL_FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("Llama / SmolLM2", LlamaForCausalLM, "LlamaForCausalLM", "llama", ("llama",)),
    ModelFamily("Mistral", MistralForCausalLM, "MistralForCausalLM", "mistral"),
    ModelFamily("Qwen2", Qwen2ForCausalLM, "Qwen2ForCausalLM", "qwen2"),
    ModelFamily("Qwen3", Qwen3ForCausalLM, "Qwen3ForCausalLM", "qwen3"),
    ModelFamily("Gemma 3 (text)", Gemma3ForCausalLM, "Gemma3ForCausalLM", "gemma3_text", ("gemma3",)),
    ModelFamily("Phi-3", Phi3ForCausalLM, "Phi3ForCausalLM", "phi3"),
    ModelFamily("LLaVA (CLIP + Llama; images in)", LlavaForConditionalGeneration, "LlavaForConditionalGeneration",
                "llava"),
    ModelFamily("Gemma 3 (SigLIP + Gemma 3, bidirectional image attention; images in)", Gemma3ForConditionalGeneration,
                "Gemma3ForConditionalGeneration", "gemma3"),
    ModelFamily("SmolVLM / Idefics3 (SigLIP tiles + pixel shuffle + Llama; images in)",
                Idefics3ForConditionalGeneration, "Idefics3ForConditionalGeneration", "idefics3"),
    ModelFamily("Qwen2-VL (ViT + Qwen2, M-RoPE; images in)", Qwen2VLForConditionalGeneration,
                "Qwen2VLForConditionalGeneration", "qwen2_vl"),
    ModelFamily("Qwen2.5-VL (window-attention ViT + Qwen2, M-RoPE; images in)", Qwen2_5_VLForConditionalGeneration,
                "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
    ModelFamily("Mixtral (MoE)", MixtralForCausalLM, "MixtralForCausalLM", "mixtral"),
    ModelFamily("Qwen2-MoE", Qwen2MoeForCausalLM, "Qwen2MoeForCausalLM", "qwen2_moe"),
    ModelFamily("Qwen3-MoE", Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM", "qwen3_moe"),
    # Pooling-only (runner="pooling"); the plain BertModel comes last so that model_type "bert" selects it.
    ModelFamily("BERT cross-encoder", BertForSequenceClassification, "BertForSequenceClassification", "bert"),
    ModelFamily("BERT (embeddings)", BertModel, "BertModel", "bert"),
)
_ARCHITECTURES = {f.architecture: f.model_class for f in MODEL_FAMILIES}
_MODEL_TYPES = {f.model_type: f.model_class for f in MODEL_FAMILIES}


def supported_architectures() -> list[str]:
    """Names accepted by `get_model_class`."""
    return sorted(_ARCHITECTURES)


def format_supported_models() -> str:
    """The table `pagemill env --models` prints: family, HF architecture, model_type, tested GGUF architectures."""
    rows = [("family", "HF architecture", "model_type", "GGUF general.architecture")]
    rows += [(f.name, f.architecture, f.model_type, ", ".join(f.gguf_architectures) or "-") for f in MODEL_FAMILIES]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


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
