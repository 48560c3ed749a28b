"""ModelConfig: which model runs and how (path, dtype, context length, quantization), and the linear-layer options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# int8: the speed preset of csrc/cpu/variant/gemv_i8.cpp; the exact float32 default keeps HF parity.
LINEAR_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
WEIGHT_ONLY_QUANTIZATIONS = ("int8", "int4")  # float checkpoints quantized at load (layers/quantization/weight_only.py)
# quantized checkpoints, named by their quantization_config.quant_method (layers/quantization/prequantized.py)
CHECKPOINT_QUANTIZATIONS = ("gptq", "awq", "compressed-tensors", "fp8")
QUANTIZATIONS = ("auto", "none", "gguf", *WEIGHT_ONLY_QUANTIZATIONS, *CHECKPOINT_QUANTIZATIONS)


def check_linear_options(linear_dtype: str, quantization: str) -> None:
    """Raise a ValueError naming the field for an unknown linear_dtype or quantization."""
    if linear_dtype not in LINEAR_DTYPES:
        raise ValueError(f"linear_dtype must be one of {', '.join(LINEAR_DTYPES)}, got {linear_dtype!r}.")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}.")


def resolve_quantization(quantization: str, from_gguf: bool, checkpoint_method: Any = None) -> str:
    """auto = keep GGUF weights in their block formats (it changes no weight value), a quantized checkpoint's own
    method (`checkpoint_method`: its quantization_config.quant_method, or None), else none; gguf needs a GGUF file
    (the blocks are read from it); int8 / int4 need float weights (safetensors), not a GGUF file's; a quantized
    checkpoint runs only as what it is."""
    check_linear_options("auto", quantization)
    if checkpoint_method is not None and checkpoint_method not in CHECKPOINT_QUANTIZATIONS:
        raise ValueError(f"quantization_config.quant_method must be one of {', '.join(CHECKPOINT_QUANTIZATIONS)}, "
                         f"got {checkpoint_method!r}.")
    if quantization == "auto":
        return "gguf" if from_gguf else checkpoint_method or "none"
    if checkpoint_method is not None and quantization != checkpoint_method:
        raise ValueError(f"quantization={quantization!r} does not fit this checkpoint, quantized with "
                         f"quantization_config.quant_method={checkpoint_method!r}: use quantization='auto' or "
                         f"{checkpoint_method!r}.")
    if quantization in CHECKPOINT_QUANTIZATIONS and checkpoint_method is None:
        raise ValueError(f"quantization={quantization!r} needs a checkpoint whose config.json has a "
                         "quantization_config with that quant_method.")
    if quantization == "gguf" and not from_gguf:
        raise ValueError("quantization='gguf' needs a GGUF model file (the blocks are read from it).")
    if quantization in WEIGHT_ONLY_QUANTIZATIONS and from_gguf:
        raise ValueError(f"quantization={quantization!r} quantizes a float (safetensors) checkpoint at load; this "
                         "model is a GGUF file, already quantized: use quantization='auto' (its own blocks) or 'none'.")
    return quantization


@dataclass
class ModelConfig:
    """Which model to run and how: path, dtype, context length, and the HF config it was loaded with.

    Fields named like an EngineArgs field mean what its help says (engine/arg_utils.py, the one place arguments are
    documented); comments here only say what the engine resolved.
    """

    model: str
    dtype: torch.dtype
    max_model_len: int
    hf_config: Any  # a multimodal model's text config (its whole config: mm_hf_config)
    tokenizer: str
    gguf_file: str | None = None
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    seed: int = 0
    linear_dtype: str = "auto"
    quantization: str = "none"  # resolved: never auto
    runner_type: str = "generate"  # resolved from runner / task: generate | pooling
    pooler_config: Any = None  # config.pooling.PoolerConfig of a pooling model, else None
    max_logprobs: int = 20
    max_n: int = 128  # resolved: max_num_seqs when not given
    mm_hf_config: Any = None  # a multimodal model's whole HF config (vision + text), else None
    limit_mm_per_prompt: dict[str, int] | None = None  # None: the default, 8 images
    allowed_local_media_path: str | None = None

    @property
    def is_multimodal(self) -> bool:
        """Whether the model takes images."""
        return self.mm_hf_config is not None

    # vLLM's ModelConfig accessors (read from the HF config)
    def get_vocab_size(self) -> int:
        """The vocabulary size."""
        return self.hf_config.vocab_size

    def get_hidden_size(self) -> int:
        """The hidden size."""
        return self.hf_config.hidden_size

    def get_num_layers(self, parallel_config: Any = None) -> int:
        """Number of transformer layers (all stages)."""
        return self.hf_config.num_hidden_layers

    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        """Number of query heads (all ranks)."""
        return self.hf_config.num_attention_heads

    def get_head_size(self) -> int:
        """Size of one attention head."""
        return self.head_dim

    @property
    def architectures(self) -> list[str]:
        """The HF architecture names."""
        return list(getattr(self.hf_config, "architectures", None) or [self.architecture])

    @property
    def tokenizer_mode(self) -> str:
        """vLLM's tokenizer_mode (always auto here)."""
        return "auto"

    @property
    def trust_remote_code(self) -> bool:
        """vLLM's trust_remote_code (never: no remote code runs)."""
        return False

    @property
    def architecture(self) -> str:
        """The HF architecture name (e.g. LlamaForCausalLM)."""
        c = self.mm_hf_config or self.hf_config
        archs = getattr(c, "architectures", None) or []
        return archs[0] if archs else c.model_type

    @property
    def num_layers(self) -> int:
        """Number of transformer layers."""
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        """Number of key/value heads (GQA)."""
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def name(self) -> str:
        """The name the server reports for this model."""
        return self.served_model_name or self.model
