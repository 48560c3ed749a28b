"""Engine configuration: one place owns each fact (model, cache, scheduler limits, parallelism, features).

Plain dataclasses that import nothing above them; engine/arg_utils.py builds them from the user's EngineArgs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from pagemill.utils.config_json import config_from_user

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
               "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MB', '1.5g'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"kv_cache_memory must be a size like '2GiB' or a number of bytes, got {value!r}.")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


# int8: activations quantized per row and block of 32 and multiplied in integers against quantized weights (a speed
# preset: csrc/variant/gemv_i8.cpp; the exact float32 default keeps HF parity)
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
    """Which model to run and how: path, dtype, context length, and the HF config it was loaded with."""

    model: str
    dtype: torch.dtype
    max_model_len: int
    hf_config: Any
    tokenizer: str
    gguf_file: str | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: token ids in, token ids out
    served_model_name: str | None = None
    seed: int = 0
    linear_dtype: str = "auto"  # matmul precision; auto = the model dtype (exact float32)
    quantization: str = "none"  # none | gguf | int8 | int4 | gptq | awq | compressed-tensors | fp8 (resolved)
    runner_type: str = "generate"  # generate | pooling (embeddings, scores: pagemill/pooling/)
    pooler_config: Any = None  # pooling.config.PoolerConfig of a pooling model, else None
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (-1: no limit)
    max_n: int = 128  # most sequences one request may fan out to (n, best_of)
    # A multimodal model's whole HF config (vision + text; hf_config is then its text config), else None.
    mm_hf_config: Any = None
    limit_mm_per_prompt: dict[str, int] | None = None  # most images per prompt (None: the default, 8)
    allowed_local_media_path: str | None = None  # file:// image URLs are read only under this directory

    @property
    def is_multimodal(self) -> bool:
        """Whether the model takes images."""
        return self.mm_hf_config is not None

    # vLLM's ModelConfig accessors (read from the HF config)
    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_config.hidden_size

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self.hf_config.num_hidden_layers

    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        return self.hf_config.num_attention_heads

    def get_head_size(self) -> int:
        hf = self.hf_config
        return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [self.architecture])

    @property
    def tokenizer_mode(self) -> str:
        return "auto"

    @property
    def trust_remote_code(self) -> bool:
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


# fp8 / fp8_e4m3 / fp8_e5m2 / int8: one byte per element plus a float32 scale per token and head
# (attention/kv_quant.py); fp8 is e4m3, as in vLLM.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
KV_CACHE_LAYOUTS = ("paged", "virtual")


@dataclass
class CacheConfig:
    """Paged KV cache: block size, memory budget, prefix caching."""

    block_size: int = 16
    kv_cache_memory: int = 2 * 2**30
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    num_gpu_blocks_override: int | None = None  # exact number of blocks (tests)
    swap_space: int = 4 * 2**30  # bytes of host memory for swapped-out blocks (preemption_mode="swap")
    kv_cache_dtype: str = "auto"  # auto = the model dtype; float16/bfloat16 halve, fp8/int8 quarter the KV bytes
    kv_cache_layout: str = "paged"  # paged blocks, or virtual: each request's KV contiguous (worker/virtual_kv.py)
    # share of the GPU's memory the engine may use (CUDA, kv_cache_memory 0: the KV cache gets what a profiled forward
    # leaves of it); None on the CPU
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}.")
        if self.prefix_caching_hash_algo not in ("builtin", "sha256"):
            raise ValueError("prefix_caching_hash_algo must be 'builtin' or 'sha256'.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}.")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)}, "
                             f"got {self.kv_cache_layout!r}.")


SCHEDULING_POLICIES = ("fcfs", "priority", "srtf", "two-level")


@dataclass
class SchedulerConfig:
    """Per-step limits and the scheduling policy (core/sched_policy.py: srtf and two-level)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    # srtf aging: a waiting request that has seen this many admissions since it was first queued goes first (FIFO).
    max_passed_over: int = 64
    staging_size: int = 8  # two-level: requests moved from the FIFO waiting queue to the SRTF staging queue at once
    # Schedule step N+1 while the model runs step N (engine/core.py step_with_batch_queue; vLLM's async scheduling).
    async_scheduling: bool = False
    # Image placeholder tokens whose encoder runs one step may start (vLLM's encoder budget; None: the token budget).
    # A step that would start more stops the request's chunk before the image; an image larger than the budget
    # still runs when it is the step's first.
    max_num_encoder_input_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens < 1:
            raise ValueError("max_num_encoder_input_tokens must be >= 1.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.policy!r}.")
        if self.max_passed_over < 0:
            raise ValueError(f"scheduling_max_passed_over must be >= 0, got {self.max_passed_over}.")
        if self.staging_size < 1:
            raise ValueError(f"scheduling_staging_size must be >= 1, got {self.staging_size}.")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1.")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1.")


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class StructuredOutputsConfig:
    """Structured output (guided decoding): which grammar library compiles the constraints, and JSON whitespace."""

    backend: str = "auto"  # auto: xgrammar unless the constraint needs what only llguidance has
    max_json_whitespace: int = 2  # most whitespace characters between JSON tokens (0: none)
    # --reasoning-parser (vLLM keeps it here too): a grammar starts after the reasoning end marker, and
    # thinking_token_budget forces that marker; the start / end strings override the parser's (--reasoning-config).
    reasoning_parser: str | None = None
    reasoning_start_str: str | None = None
    reasoning_end_str: str | None = None
    # vLLM's structured_outputs_config fields; each is also the default of the request field of the same name
    disable_fallback: bool = False  # auto: no second backend tried when the first one refuses a constraint
    disable_any_whitespace: bool = False  # JSON: compact, no whitespace between tokens
    disable_additional_properties: bool = False  # JSON schema objects without additionalProperties get false
    enable_in_reasoning: bool = False  # the grammar applies from the first token, thinking included

    def __post_init__(self) -> None:
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                     "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be a boolean, got {getattr(self, name)!r}.")
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                             f"got {self.backend!r}.")
        if self.max_json_whitespace < 0:
            raise ValueError("structured_outputs max_json_whitespace must be >= 0.")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): who proposes draft tokens and how many per step.

    Proposals are verified by the target model in one step with an exact rejection sampler; a back-off turns
    speculation off for requests whose drafts are rarely accepted and for batches too large to verify for free.
    """

    method: str = "ngram"  # ngram (prompt lookup) | suffix (suffix tree, model-free) | draft_model
    num_speculative_tokens: int | None = None  # k; default 4 (ngram, draft_model) or 8 (suffix)
    prompt_lookup_min: int = 2  # ngram: shortest n-gram to match
    prompt_lookup_max: int = 5  # ngram: longest n-gram to match
    model: str | None = None  # draft_model: a smaller model with the target's tokenizer (default: the target)
    draft_num_layers: int | None = None  # draft_model: use only the draft's first N layers
    suffix_decoding_max_tree_depth: int = 24  # suffix: longest context suffix matched / stored
    suffix_decoding_max_cached_requests: int = 1000  # suffix: finished requests kept in the global tree
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: at most this x the match length draft tokens
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop drafting below this estimated probability
    # Back-off: no drafts while the running batch is this large or more (verification stops being free) ...
    max_batch_size: int = 8
    # ... nor for a request whose recent acceptance (tokens accepted per draft token, moving average) is below this
    # or below the measured cost of proposing and verifying a draft token, if higher (negative: no back-off).
    min_acceptance_rate: float = 0.15
    # draft_model with `model`: the draft's ModelConfig, resolved with the engine's (not user input).
    draft_model_config: ModelConfig | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}.")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 8 if self.method == "suffix" else 4
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 32], "
                             f"got {self.num_speculative_tokens}.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}.")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"speculative_config.draft_num_layers must be >= 1, got {self.draft_num_layers}.")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError("speculative_config.suffix_decoding_max_tree_depth must be >= 1.")
        if self.max_batch_size < 1:
            raise ValueError("speculative_config.max_batch_size must be >= 1.")

    @classmethod
    def from_user(cls, value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Build from a dict, its JSON text (the CLI's --speculative-config) or a config; None stays None.
        Unknown keys raise a ValueError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        known = {f.name for f in fields(cls)} - {"draft_model_config"}
        return config_from_user(cls, value, "speculative_config", known)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig:
    """Multi-LoRA serving: adapter slots applied in one batch, and adapters kept on the host beyond them."""

    max_loras: int = 1  # adapters one step can mix (each holds a slot in the stacked LoRA weights)
    max_lora_rank: int = 16  # the largest adapter rank accepted (slots are this wide)
    max_cpu_loras: int | None = None  # adapters kept loaded on the host (LRU); None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")


DP_ROUTING_POLICIES = ("prefix-affinity", "least-loaded")


@dataclass
class DataParallelConfig:
    """Data parallelism: N engine cores, each with its own scheduler and KV cache, behind one front end."""

    data_parallel_size: int = 1
    routing: str = "prefix-affinity"  # dp_routing: least-loaded | prefix-affinity (pagemill/engine/dp_router.py)
    # prefix-affinity: the engine holding a request's prefix gets it unless its load score (waiting x 4 + running)
    # exceeds the least-loaded engine's by more than this.
    imbalance_threshold: int = 16

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}.")
        if self.routing not in DP_ROUTING_POLICIES:
            raise ValueError(f"dp_routing must be one of {', '.join(DP_ROUTING_POLICIES)}, got {self.routing!r}.")
        if self.imbalance_threshold < 0:
            raise ValueError(f"dp_imbalance_threshold must be >= 0, got {self.imbalance_threshold}.")



DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How the model is split over worker processes (vLLM's names): tensor x pipeline ranks, and what runs them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # uni | mp | ray (None: uni for one rank, else mp)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        backend = self.distributed_executor_backend
        if backend is None:
            self.distributed_executor_backend = backend = "uni" if self.world_size == 1 else "mp"
        if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {backend!r}.")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size x "
                             f"pipeline_parallel_size = {self.world_size} needs 'mp'.")

    @property
    def world_size(self) -> int:
        """Worker processes: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Connectors by name (distributed/kv_transfer/factory.py maps them to their classes).
KV_CONNECTORS = ("SharedStorageConnector", "ZmqConnector")


@dataclass
class KVTransferConfig:
    """vLLM's KVTransferConfig fields that pagemill's connectors use.

    kv_producer saves the KV it computes, kv_consumer loads KV computed elsewhere instead of computing it, kv_both
    does both (a KV offload tier that is also read back on a prefix hit).
    """

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_ip: str = "127.0.0.1"  # ZmqConnector: the producer serves its KV blocks here
    kv_port: int = 14579
    kv_buffer_size: float = 1e9  # ZmqConnector: bytes of KV blocks a producer keeps for consumers (LRU)
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}.")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object.")
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a TCP port in [1, 65535], got {self.kv_port!r}.")
        if not self.kv_buffer_size > 0:
            raise ValueError(f"kv_transfer_config.kv_buffer_size must be > 0, got {self.kv_buffer_size!r}.")

    @property
    def is_kv_producer(self) -> bool:
        """Whether this engine saves the KV it computes."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """Whether this engine loads KV computed elsewhere."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_user(cls, value: dict[str, Any] | str | KVTransferConfig | None) -> KVTransferConfig | None:
        """Build from a dict, its JSON text (the CLI's --kv-transfer-config) or a config; None stays None.
        Unknown keys raise a ValueError naming them."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return config_from_user(cls, value, "kv_transfer_config")


@dataclass
class EngineConfig:
    """All the configuration of one engine."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    num_threads: int | None = None
    log_stats: bool = False
    attention_backend: str = "auto"
    profile: bool = False
    greedy_head_screen: bool = True
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: LoRA disabled
    batch_invariant: bool = False  # fixed reduction orders: a request's logits do not depend on the batch
    data_parallel_config: DataParallelConfig = field(default_factory=DataParallelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None  # a KV connector (disaggregated prefill, KV offload)
    device: str = "cpu"  # the torch device type of the model, KV cache and step buffers (the platform's)
    worker_cls: str = "auto"  # import path of the worker class (auto: the platform's Platform.worker_cls)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode batches
