"""Engine configuration: one place owns each fact (model, cache, scheduler limits)."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from pagemill.distributed.kv_transfer.kv_transfer_config import KVTransferConfig
from pagemill.utils.config_json import config_from_user

logger = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16"}

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


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a `dtype` argument; 'auto' is float32 (fastest and exact on CPUs without AMX)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return getattr(torch, _DTYPES[dtype])


LINEAR_DTYPES = ("auto", "float32", "float16", "bfloat16")
WEIGHT_ONLY_QUANTIZATIONS = ("int8", "int4")  # float checkpoints quantized at load (layers/quantization/weight_only.py)
QUANTIZATIONS = ("auto", "none", "gguf", *WEIGHT_ONLY_QUANTIZATIONS)


def check_linear_options(linear_dtype: str, quantization: str) -> None:
    """Raise a ValueError naming the field for an unknown linear_dtype or quantization."""
    if linear_dtype not in LINEAR_DTYPES:
        raise ValueError(f"linear_dtype must be one of {', '.join(LINEAR_DTYPES)}, got {linear_dtype!r}.")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}.")


def resolve_quantization(quantization: str, from_gguf: bool) -> str:
    """auto = keep GGUF weights in their block formats (it changes no weight value), else none; gguf needs a GGUF
    file (the blocks are read from it); int8 / int4 need float weights (safetensors), not a GGUF file's."""
    check_linear_options("auto", quantization)
    if quantization == "auto":
        return "gguf" if from_gguf else "none"
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
    served_model_name: str | None = None
    seed: int = 0
    linear_dtype: str = "auto"  # matmul precision; auto = the model dtype (exact float32)
    quantization: str = "none"  # none | gguf | int8 | int4 (resolved from auto)
    runner_type: str = "generate"  # generate | pooling (embeddings, scores: pagemill/pooling/)
    pooler_config: Any = None  # pooling.config.PoolerConfig of a pooling model, else None
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (-1: no limit)
    max_n: int = 128  # most sequences one request may fan out to (n, best_of)

    @property
    def architecture(self) -> str:
        """The HF architecture name (e.g. LlamaForCausalLM)."""
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else self.hf_config.model_type

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


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
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
    kv_cache_dtype: str = "auto"  # auto = the model dtype; float16/bfloat16 halve attention's memory traffic
    kv_cache_layout: str = "paged"  # paged blocks, or virtual: each request's KV contiguous (worker/virtual_kv.py)

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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
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
        return config_from_user(cls, value, "speculative_config")


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

    @classmethod
    def from_args(cls, args: EngineArgs) -> DataParallelConfig:
        """The data-parallel part of the user's arguments (validated)."""
        return cls(args.data_parallel_size, args.dp_routing, args.dp_imbalance_threshold)


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


@dataclass
class EngineArgs:
    """User-facing engine arguments (vLLM names); `create_engine_config` resolves them."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    max_logprobs: int = 20  # most logprobs / prompt_logprobs per request, as vLLM (-1: no limit)
    max_n: int | None = None  # most sequences per request (n, best_of); None: max_num_seqs
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    scheduling_policy: str = "fcfs"  # fcfs | priority | srtf | two-level
    scheduling_max_passed_over: int = 64  # srtf: admissions a waiting request may see before it goes first
    scheduling_staging_size: int = 8  # two-level: size of the SRTF staging queue
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB
    seed: int = 0
    served_model_name: str | None = None
    num_gpu_blocks_override: int | None = None
    num_threads: int | None = None
    attention_backend: str = "auto"
    linear_dtype: str = "auto"  # float16/bfloat16: 3-4x faster GEMMs, top-1 within 99% of float32
    kv_cache_dtype: str = "auto"  # float16/bfloat16: half the KV bytes (attention reads, cache capacity)
    kv_cache_layout: str = "paged"  # virtual: vTensor-style contiguous per-request KV over mapped chunks (Linux)
    quantization: str = "auto"  # gguf (auto for GGUF files): small-batch GEMVs stream the Q4_1/Q8_0 weights as stored;
    # int8 / int4: a safetensors model's linears quantized at load (weight-only, groups of 16 / 32) for the same GEMVs
    profile: bool = False  # time each part of the engine step (StepProfiler)
    # Greedy rows pick their token from an int8 screen of the LM head plus an exact float32 recheck of the few
    # tokens that could win (layers/head_screen.py): the same tokens, at int8 speed.
    greedy_head_screen: bool = True
    disable_log_stats: bool = True
    structured_outputs_backend: str = "auto"  # auto | xgrammar | guidance (structured output / guided decoding)
    speculative_config: dict[str, Any] | str | None = None  # SpeculativeConfig's fields, as a dict or JSON text
    enable_lora: bool = False  # serve LoRA adapters (LoRARequest per request)
    max_loras: int = 1  # adapters one batch can mix
    max_lora_rank: int = 16  # the largest adapter rank accepted
    max_cpu_loras: int | None = None  # adapters kept loaded on the host (default: max_loras)
    # Fixed-order matmuls and attention (layers/batch_invariant.py): a request's logits, and so its seeded samples,
    # are the same bits alone, in any batch, chunked or after a prefix hit.
    batch_invariant: bool = False
    # Schedule step N+1 while the model runs step N (at most 2 steps in flight; vLLM's async scheduling).
    async_scheduling: bool = False
    # Accepted for vLLM scripts; it has no meaning on a CPU (the KV cache is sized by kv_cache_memory).
    gpu_memory_utilization: float | None = None
    runner: str = "auto"  # generate | pooling (auto: pooling for embedding / cross-encoder architectures such as BERT)
    task: str | None = None  # vLLM's older spelling of runner: embed / classify / score -> pooling, generate
    pooler_config: dict[str, Any] | str | None = None  # pooling: {"pooling_type": CLS|MEAN|LAST, "normalize": bool}
    data_parallel_size: int = 1  # engine cores behind the front end, each on cores / N threads (its own KV cache)
    dp_routing: str = "prefix-affinity"  # least-loaded (vLLM) | prefix-affinity (SGLang's cache-aware router)
    dp_imbalance_threshold: int = 16  # prefix-affinity: load-score lead over the least-loaded engine it tolerates
    tensor_parallel_size: int = 1  # ranks each layer's weights and heads are split over
    pipeline_parallel_size: int = 1  # stages the layers are split over
    distributed_executor_backend: str | None = None  # uni | mp | ray (None: uni for one rank, else mp processes)
    kv_transfer_config: dict[str, Any] | str | None = None  # KVTransferConfig's fields, as a dict or JSON text

    @classmethod
    def field_names(cls) -> list[str]:
        """The argument names (used to build CLI flags and to filter kwargs)."""
        return [f.name for f in fields(cls)]

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """Add one flag per field to an argparse parser (vLLM's `EngineArgs.add_cli_args`); returns the parser."""
        from pagemill.entrypoints.openai.cli_args import add_engine_args

        add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: Any) -> EngineArgs:
        """EngineArgs from a namespace parsed with `add_cli_args`' flags (vLLM's `EngineArgs.from_cli_args`)."""
        return cls(**{name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)})

    def create_engine_config(self) -> EngineConfig:
        """Load the model's config and resolve every default."""
        from pagemill.loader.model_files import resolve_model

        resolved = resolve_model(self.model, self.tokenizer)
        hf_config = resolved.hf_config
        model_max = getattr(hf_config, "max_position_embeddings", None) or 8192
        pooler = _resolve_pooling(self, resolved.path, hf_config)
        if pooler is not None and pooler.max_seq_length:
            model_max = min(model_max, pooler.max_seq_length)
        max_model_len = self.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's context length ({model_max})."
            )
        check_linear_options(self.linear_dtype, self.quantization)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs}.")
        if self.max_n is not None and self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}.")
        so_config = StructuredOutputsConfig(backend=self.structured_outputs_backend)
        spec_config = SpeculativeConfig.from_user(self.speculative_config)
        lora_config = (LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora
                       else None)
        if lora_config is not None and pooler is not None:
            raise ValueError("enable_lora: LoRA adapters apply to generating models, not to the pooling runner.")
        if self.batch_invariant:
            check_batch_invariant(self)
        dp_config = DataParallelConfig.from_args(self)
        parallel_config = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                         self.distributed_executor_backend)
        if parallel_config.world_size > 1:
            check_parallel(self, parallel_config, hf_config, pooler is not None, resolved.gguf_file is not None)
        if dp_config.data_parallel_size > 1 and parallel_config.world_size > 1:
            raise ValueError("data_parallel_size > 1 cannot be combined with tensor_parallel_size or "
                             "pipeline_parallel_size > 1 yet (each engine core would need its own worker group).")
        check_kv_cache_layout(self)
        kv_transfer_config = KVTransferConfig.from_user(self.kv_transfer_config)
        if kv_transfer_config is not None:
            check_kv_transfer(self, pooler is not None)
        if self.async_scheduling:
            check_async_scheduling(self, parallel_config)
        max_batched = self.max_num_batched_tokens or max(2048, 0)
        if pooler is not None and pooler.encoder_only and max_batched < max_model_len:  # one step per prompt
            if self.max_num_batched_tokens is not None:
                raise ValueError(f"max_num_batched_tokens ({max_batched}) must be >= max_model_len ({max_model_len}) "
                                 "for an encoder-only model: it computes a whole prompt in one step.")
            max_batched = max_model_len
        kv_bytes = parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else _default_kv_bytes()
        model_config = ModelConfig(
            model=resolved.path,
            dtype=resolve_dtype(self.dtype),
            max_model_len=max_model_len,
            hf_config=hf_config,
            tokenizer=resolved.tokenizer_path,
            gguf_file=resolved.gguf_file,
            served_model_name=self.served_model_name,
            seed=self.seed,
            linear_dtype=self.linear_dtype,
            quantization=resolve_quantization(self.quantization, resolved.gguf_file is not None),
            runner_type="generate" if pooler is None else "pooling", pooler_config=pooler,
            max_logprobs=self.max_logprobs, max_n=self.max_n or self.max_num_seqs,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=kv_bytes,
            # pooling: mean pooling needs every token's hidden state, and nothing outlives a request
            enable_prefix_caching=self.enable_prefix_caching and pooler is None,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            swap_space=int(self.swap_space * 2**30),
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_layout=self.kv_cache_layout,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            max_passed_over=self.scheduling_max_passed_over,
            staging_size=self.scheduling_staging_size,
            async_scheduling=self.async_scheduling,
        )
        return EngineConfig(model_config, cache_config, scheduler_config,
                            num_threads=self.num_threads, log_stats=not self.disable_log_stats,
                            attention_backend=self.attention_backend, profile=self.profile,
                            # (batch-invariant: off, its exact recheck sums in another order than the head)
                            greedy_head_screen=self.greedy_head_screen and not self.batch_invariant and pooler is None,
                            structured_outputs_config=so_config,
                            speculative_config=spec_config, lora_config=lora_config,
                            batch_invariant=self.batch_invariant, data_parallel_config=dp_config,
                            parallel_config=parallel_config, kv_transfer_config=kv_transfer_config)


def check_batch_invariant(args: EngineArgs) -> None:
    """Raise a ValueError naming the option that batch_invariant=True cannot be combined with."""
    import torch

    if resolve_dtype(args.dtype) != torch.float32 or args.linear_dtype not in ("auto", "float32"):
        raise ValueError("batch_invariant=True runs in float32: dtype and linear_dtype must be auto or float32.")
    if args.attention_backend == "torch":
        raise ValueError("batch_invariant=True needs the compiled CPU attention kernel: attention_backend must be "
                         "auto or cpu, not torch.")
    if args.speculative_config is not None:
        raise ValueError("batch_invariant=True cannot be combined with speculative_config: which drafts a request "
                         "gets (and so its random draws) depends on the batch.")
    if args.enable_lora:
        raise ValueError("batch_invariant=True does not cover LoRA adapters yet (enable_lora).")


def check_async_scheduling(args: EngineArgs, parallel: ParallelConfig) -> None:
    """Raise a ValueError naming the option that async_scheduling=True cannot be combined with (structured output
    is served: its steps run synchronously, see EngineCore.step_with_batch_queue)."""
    if args.speculative_config is not None:
        raise ValueError("async_scheduling=True cannot be combined with speculative_config yet: the next step's "
                         "draft tokens depend on the token the step in flight has not sampled yet.")
    if parallel.world_size > 1:
        raise ValueError("async_scheduling=True does not run with tensor_parallel_size or pipeline_parallel_size "
                         "> 1 yet: the ranks other than the driver learn each step's tokens with the next step.")


def check_parallel(args: EngineArgs, parallel: ParallelConfig, hf_config: Any, pooling: bool, gguf: bool) -> None:
    """Raise a ValueError naming the field that tensor / pipeline parallelism cannot be combined with, or the model
    size that does not split."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    what = f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
    if args.enable_lora:
        raise ValueError(f"enable_lora: LoRA adapters do not run with {what} yet (use one rank).")
    if args.speculative_config is not None:
        raise ValueError(f"speculative_config: speculative decoding does not run with {what} yet (use one rank).")
    if pooling:
        raise ValueError(f"runner: pooling models do not run with {what} yet (use one rank).")
    if args.batch_invariant:
        raise ValueError(f"batch_invariant=True is not covered with {what} (use one rank).")
    if tp > 1 and gguf and resolve_quantization(args.quantization, True) == "gguf":
        raise ValueError(f"quantization: GGUF blocks are not sliced over tensor-parallel ranks; use "
                         f"quantization='none' (the file's weights decoded to float) with tensor_parallel_size={tp}.")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if tp > 1 and (heads % tp or (kv_heads % tp and tp % kv_heads)):
        raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {heads} attention heads and divide or "
                         f"be a multiple of its {kv_heads} key/value heads.")
    if tp > 1 and hf_config.vocab_size % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's vocabulary ({hf_config.vocab_size}).")
    if pp > hf_config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size ({pp}) is larger than the model's {hf_config.num_hidden_layers} "
                         "layers.")


def check_kv_cache_layout(args: EngineArgs) -> None:
    """Raise a ValueError naming the option that kv_cache_layout='virtual' cannot be combined with."""
    if args.kv_cache_layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)}, got {args.kv_cache_layout!r}.")
    if args.kv_cache_layout == "paged":
        return
    if args.attention_backend == "cpu" or args.batch_invariant:
        raise ValueError("kv_cache_layout='virtual' has its own attention (SDPA over contiguous KV): it cannot be "
                         "combined with attention_backend='cpu' or batch_invariant=True.")
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        raise ValueError("kv_cache_layout='virtual' does not run with tensor_parallel_size or pipeline_parallel_size "
                         "> 1 yet (use kv_cache_layout='paged').")
    spec = SpeculativeConfig.from_user(args.speculative_config)
    if spec is not None and spec.method == "draft_model":
        raise ValueError("kv_cache_layout='virtual' does not cover a draft model's KV cache "
                         "(speculative_config method draft_model).")


def check_kv_transfer(args: EngineArgs, pooling: bool) -> None:
    """Raise a ValueError naming what kv_transfer_config cannot be combined with (yet)."""
    if args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size > 1:
        raise ValueError("kv_transfer_config: KV connectors run with one rank and one engine yet (tensor, pipeline "
                         "and data parallel sizes 1); scale out with several prefill / decode instances instead.")
    if args.kv_cache_layout != "paged":
        raise ValueError("kv_transfer_config: KV connectors move paged KV blocks (kv_cache_layout='paged').")
    if pooling:
        raise ValueError("kv_transfer_config: a pooling model keeps no KV to transfer.")
    spec = SpeculativeConfig.from_user(args.speculative_config)
    if spec is not None and spec.method == "draft_model":
        raise ValueError("kv_transfer_config: KV connectors do not move a draft model's KV cache yet "
                         "(speculative_config method draft_model).")


def _resolve_pooling(args: EngineArgs, model_path: str, hf_config: Any) -> Any:
    """The PoolerConfig of a model run with the pooling runner, else None; checks what pooling rules out."""
    from pagemill.pooling.config import resolve_pooler_config, resolve_runner

    if resolve_runner(args.runner, args.task, hf_config) != "pooling":
        if args.pooler_config is not None:
            raise ValueError("pooler_config applies to pooling models only (runner='pooling').")
        return None
    if args.speculative_config is not None:
        raise ValueError("speculative_config: a pooling model generates no tokens to speculate on.")
    return resolve_pooler_config(args.pooler_config, model_path, hf_config)


def _default_kv_bytes() -> int:
    """Default KV budget: 2 GiB, or a quarter of available memory if that is smaller."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 * 2**30
    return int(min(2 * 2**30, avail // 4))
