"""EngineArgs: the engine's arguments as users give them (vLLM's names and `engine/arg_utils.py`), their command-line
flags, and `create_engine_config`, which resolves them into an EngineConfig and checks what cannot go together."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from pagemill.config import (CHECKPOINT_QUANTIZATIONS, DP_ROUTING_POLICIES, KV_CACHE_LAYOUTS,
                             STRUCTURED_OUTPUT_BACKENDS, CacheConfig, DataParallelConfig, DeviceConfig, EngineConfig,
                             KVTransferConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, StructuredOutputsConfig, check_linear_options, resolve_quantization)
from pagemill.loader.model_files import resolve_model
from pagemill.platforms import current_platform
from pagemill.reasoning import reasoning_parser_names
from pagemill.utils.argparse_utils import json_dict_flag

if TYPE_CHECKING:
    import torch

_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16"}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a `dtype` argument; 'auto' is the platform's default (float32 on the CPU)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return current_platform.default_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return getattr(torch, _DTYPES[dtype])


def _arg(default: Any, help: str) -> Any:
    """An EngineArgs field whose help text (the one place an argument is documented: `--help`, the engine-arguments
    reference) rides in its metadata; argparse %-formats help, so a '%' is refused here."""
    if not help.strip() or "%" in help:
        raise ValueError(f"EngineArgs help must be non-empty and free of '%' (argparse formats it): {help!r}")
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """User-facing engine arguments (vLLM names); `create_engine_config` resolves them.

    Each field's help is its `metadata["help"]` (see `arg_help`): the CLI flags and the docs' engine-arguments page
    are generated from it, and nothing else repeats it.
    """

    model: str | None = _arg(None, "HF model directory or .gguf file (None: the embedded SmolLM2-135M-Instruct).")
    tokenizer: str | None = _arg(None,
        "A local HF tokenizer directory (or .gguf file) to use instead of the model's own tokenizer.")
    skip_tokenizer_init: bool = _arg(False,
        "Start without a tokenizer (token-in / token-out, as vLLM): prompts must be token ids, outputs carry token "
        "ids and no text.")
    dtype: str = _arg("auto", "Weight and activation dtype: auto (float32), float32, bfloat16, float16.")
    max_model_len: int | None = _arg(None, "Context length (None: the model's).")
    max_num_seqs: int = _arg(128, "Most sequences in one batch.")
    max_num_batched_tokens: int | None = _arg(None, "Token budget of one engine step.")
    max_logprobs: int = _arg(20, "Most logprobs / top_logprobs / prompt_logprobs a request may ask for (-1: no limit).")
    max_n: int | None = _arg(None, "Most sequences one request may ask for (n, best_of; None: max_num_seqs).")
    block_size: int = _arg(16, "Tokens per KV-cache block.")
    kv_cache_memory: int | str | None = _arg(None,
        "KV-cache memory, e.g. 2GiB or 512MiB (None: 2 GiB or a quarter of free memory).")
    enable_prefix_caching: bool = _arg(True, "Reuse the KV blocks of shared prompt prefixes.")
    prefix_caching_hash_algo: str = _arg("builtin", "Block hash: builtin or sha256.")
    scheduling_policy: str = _arg("fcfs",
        "fcfs, priority (lower `priority` values first), srtf (shortest remaining tokens first: prompt left plus "
        "expected outputs, with aging) or two-level (FIFO into a staging queue, SRTF within it).")
    scheduling_max_passed_over: int = _arg(64,
        "srtf aging: a waiting request that has seen this many admissions since it was first queued is served before "
        "the others, in FIFO order.")
    scheduling_staging_size: int = _arg(8,
        "two-level: requests moved from the FIFO queue into the SRTF staging queue at once (only when it is empty).")
    preemption_mode: str = _arg("recompute",
        "What a preempted request loses: recompute (its KV blocks are freed and its tokens computed again, mostly "
        "found in the prefix cache) or swap (its blocks copied to host swap space).")
    swap_space: float = _arg(4.0, "GiB of host memory for swapped-out KV blocks (preemption_mode swap).")
    seed: int = _arg(0, "Random seed.")
    served_model_name: str | None = _arg(None,
        "The model's name in the API (`model` field, /v1/models); None: SmolLM2-135M-Instruct for the default model, "
        "else the model path's basename.")
    num_gpu_blocks_override: int | None = _arg(None, "Exact number of KV blocks (testing).")
    num_threads: int | None = _arg(None, "Torch threads of the engine core (None: all cores).")
    attention_backend: str = _arg("auto",
        "auto (the platform's choice: on the CPU the compiled kernel, else the torch reference), cpu torch, or "
        "triton (the CUDA platform's Triton kernels; on the CPU through Triton's interpreter: slow, for checking "
        "them); kv_cache_layout virtual brings its own (leave auto).")
    linear_dtype: str = _arg("auto",
        "Matmul dtype of the linear layers: auto (exact float32), float32, float16 or bfloat16 (3-4x faster "
        "large-batch matmuls on AVX512-FP16/BF16 CPUs; top-1 agreement with float32 >= 0.99 for float16, ~0.98 for "
        "bfloat16), or int8: activations quantized per row and block of 32 (256 for Q4_K / Q6_K with VNNI) and "
        "multiplied in integers against quantized weights (GGUF, or quantization=int8/int4; a speed preset: "
        "teacher-forced top-1 agreement 0.97 on Gemma 3, 0.93 on SmolLM2).")
    kv_cache_dtype: str = _arg("auto",
        "KV-cache dtype: auto (the model dtype), float16 or bfloat16 (half the bytes attention reads, twice the "
        "tokens the cache holds), or quantized as vLLM names it: int8 (one byte per element plus a float16 scale per "
        "16 channels of a token and head: 3.56x the float32 tokens in the same kv_cache_memory; teacher-forced "
        "top-1 agreement with the float32 cache 0.991 on SmolLM2, 0.991 on Gemma 3), fp8 (= fp8_e4m3) or "
        "fp8_e5m2 (one byte per element plus a float32 scale per token and head: about 3.8x the float32 tokens; "
        "top-1 0.96 / 0.93 on SmolLM2, 0.97 / 0.93 on Gemma 3).")
    kv_cache_layout: str = _arg("paged",
        "paged (blocks and block tables) or virtual (Linux: each request's KV contiguous in reserved virtual memory, "
        "physical chunks of block_size tokens mapped on demand; vTensor).")
    quantization: str = _arg("auto",
        "auto (a GGUF file's own blocks, a quantized checkpoint's quantization_config.quant_method, else none), "
        "none, gguf, gptq / awq / compressed-tensors / fp8 (what the checkpoint is), or int8 / int4: quantize a "
        "safetensors model's linear layers at load (weight-only, per group of 16 / 32).")
    profile: bool = _arg(False,
        "Time each part of the engine step (schedule, input preparation, forward, sampling, output processing) and "
        "report the per-step breakdown.")
    greedy_head_screen: bool = _arg(True,
        "Greedy rows: int8 screen of the LM head, exact float32 recheck of the tokens that could win (same tokens, "
        "faster batched decode).")
    disable_log_stats: bool = _arg(True, "Do not log the periodic stats line.")
    structured_outputs_backend: str = _arg("auto",
        "Structured output (guided decoding) library: auto (xgrammar, or llguidance for what xgrammar lacks), "
        "xgrammar, guidance.")
    reasoning_parser: str | None = _arg(None,
        "Split a reasoning model's thinking from its answer (chat `reasoning` / `reasoning_content`, Responses "
        "reasoning items); structured output and tool calls apply to the answer only, and requests may set "
        "thinking_token_budget.")
    reasoning_config: dict[str, Any] | str | None = _arg(None,
        "JSON {\"reasoning_start_str\": ..., \"reasoning_end_str\": ...}: the markers the thinking budget counts from "
        "and forces (default: the parser's, e.g. <think> and </think>).")
    structured_outputs_config: dict[str, Any] | str | None = _arg(None,
        "vLLM's structured_outputs_config as JSON: backend, disable_fallback (auto tries no second backend), "
        "disable_any_whitespace (compact JSON), disable_additional_properties (schema objects get "
        "additionalProperties: false), reasoning_parser, enable_in_reasoning (the grammar applies to the thinking "
        "too).")
    speculative_config: dict[str, Any] | str | None = _arg(None,
        "Speculative decoding as JSON (vLLM's fields), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; "
        "method ngram, suffix or draft_model (None: off).")
    enable_lora: bool = _arg(False, "Serve LoRA adapters (PEFT directories) next to the base model.")
    max_loras: int = _arg(1, "LoRA adapters one batch can mix.")
    max_lora_rank: int = _arg(16, "The largest LoRA rank accepted.")
    max_cpu_loras: int | None = _arg(None,
        "LoRA adapters kept loaded in memory (None: max_loras); others are reloaded from disk on use.")
    batch_invariant: bool = _arg(False,
        "Fixed reduction orders in matmuls and attention: a request's logits (and seeded samples) are the same bits "
        "alone, in any batch and however its prompt is chunked (slower).")
    async_scheduling: bool = _arg(False,
        "Schedule step N+1 while the model runs step N (at most 2 steps in flight): the engine's non-forward work "
        "overlaps the forward, in a step thread. Steps with structured-output requests run synchronously; cannot be "
        "combined with speculative decoding or tensor / pipeline parallelism. Off by default: on an H200 it served "
        "256 sequences slower than synchronous steps (the two threads contend for the GIL).")
    gpu_memory_utilization: float | None = _arg(None,
        "Share of GPU memory for the KV cache (CUDA platform); accepted and ignored on the CPU, whose KV cache "
        "--kv-cache-memory sizes.")
    device: str = _arg("auto",
        "auto (the process's platform: CUDA when a GPU is visible, else the CPU), cpu or cuda; it must agree with "
        "$PAGEMILL_DEVICE where that is set.")
    worker_cls: str = _arg("auto",
        "The worker class by import path (auto: the platform's). pagemill.worker.gpu_worker.GpuWorker with "
        "attention_backend=triton runs the GPU worker's step on the CPU (Triton's interpreter: slow, for tests).")
    enforce_eager: bool = _arg(False, "Run every step module by module: no CUDA graphs (CUDA), no decoder graph (CPU).")
    runner: str = _arg("auto",
        "generate or pooling (embeddings, scores: /v1/embeddings, /pooling, /score, /rerank); auto: pooling for "
        "BERT-like embedding and cross-encoder models, else generate.")
    task: str | None = _arg(None, "vLLM's older spelling of --runner: embed, classify or score (pooling), generate.")
    pooler_config: dict[str, Any] | str | None = _arg(None,
        "Pooling as JSON, e.g. '{\"pooling_type\": \"MEAN\", \"normalize\": true}' (CLS, MEAN or LAST; None: the "
        "model's sentence-transformers settings, else CLS for BERT and LAST for decoders).")
    data_parallel_size: int = _arg(1,
        "Engine cores (processes) behind the server, each with its own scheduler and KV cache (--kv-cache-memory "
        "each), pinned to cores / N cores (--num-threads: threads per engine).")
    dp_routing: str = _arg("prefix-affinity",
        "How requests pick an engine with -dp > 1: prefix-affinity (the engine that most likely holds the prompt's "
        "prefix in its cache, unless it is overloaded) or least-loaded (waiting x 4 + running, as vLLM).")
    dp_imbalance_threshold: int = _arg(16,
        "prefix-affinity: the load score (waiting x 4 + running) by which the engine holding the prefix may exceed "
        "the least-loaded one before the request goes to the latter.")
    tensor_parallel_size: int = _arg(1,
        "Ranks (worker processes) each layer's weights, heads and KV cache are split over.")
    pipeline_parallel_size: int = _arg(1, "Pipeline stages (worker processes) the layers are split over.")
    pipeline_micro_batching: bool = _arg(True, "With pipeline_parallel_size > 1: keep one batch in flight per stage "
                                         "(micro-batches, the default); off: one batch at a time, each stage idle "
                                         "while the others run (the A/B baseline of pipeline micro-batching).")
    distributed_executor_backend: str | None = _arg(None,
        "What runs the workers: uni (one, in the engine process), mp (one process per rank; the default when tensor "
        "x pipeline parallel size > 1) or ray (one Ray actor per rank, on the nodes of a Ray cluster).")
    kv_transfer_config: dict[str, Any] | str | None = _arg(None,
        "A KV connector as JSON (vLLM's fields), e.g. '{\"kv_connector\": \"ZmqConnector\", "
        "\"kv_role\": \"kv_producer\", \"kv_port\": 14579}'; SharedStorageConnector or ZmqConnector, kv_role "
        "kv_producer (prefill), kv_consumer (decode) or kv_both.")
    max_num_encoder_input_tokens: int | None = _arg(None,
        "Image placeholder tokens whose vision encoder runs one step may start (None: the step's token budget).")
    limit_mm_per_prompt: dict[str, Any] | str | None = _arg(None,
        "Most images one prompt may carry, as JSON: '{\"image\": 4}' (default 8).")
    allowed_local_media_path: str | None = _arg(None,
        "Directory under which chat requests may name images by file:// URL (None: no local files).")

    @classmethod
    def arg_help(cls) -> dict[str, str]:
        """Each argument's help text, by field name (from the fields' metadata)."""
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}

    @classmethod
    def field_names(cls) -> list[str]:
        """The argument names (used to build CLI flags and to filter kwargs)."""
        return [f.name for f in fields(cls)]

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """Add one flag per field to an argparse parser (vLLM's `EngineArgs.add_cli_args`); returns the parser."""
        add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: Any) -> EngineArgs:
        """EngineArgs from a namespace parsed with `add_cli_args`' flags (vLLM's `EngineArgs.from_cli_args`)."""
        return cls(**{name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)})

    def create_engine_config(self) -> EngineConfig:
        """Load the model's config, resolve every default and check the result against the platform."""
        resolved = resolve_model(self.model, self.tokenizer)
        hf_config = resolved.hf_config
        mm_hf_config = None
        if getattr(hf_config, "vision_config", None) is not None:  # a vision-language model: its decoder's config
            mm_hf_config, hf_config = hf_config, hf_config.get_text_config()
        limit_mm = _limit_mm_per_prompt(self.limit_mm_per_prompt)
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
        device = resolve_device(self.device)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs}.")
        if self.max_n is not None and self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}.")
        so_config = self.create_structured_outputs_config()
        spec_config = SpeculativeConfig.from_user(self.speculative_config)
        lora_config = (LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora
                       else None)
        if lora_config is not None and pooler is not None:
            raise ValueError("enable_lora: LoRA adapters apply to generating models, not to the pooling runner.")
        if self.batch_invariant:
            check_batch_invariant(self)
        dp_config = self.create_data_parallel_config()
        parallel_config = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                         self.distributed_executor_backend, self.pipeline_micro_batching)
        if mm_hf_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("pipeline_parallel_size: a vision-language model runs on one pipeline stage (images "
                             "are merged into the first stage's embeddings; not supported across stages yet).")
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
        kv_bytes = current_platform.kv_cache_memory_bytes(self.kv_cache_memory, self.gpu_memory_utilization)
        model_config = ModelConfig(
            model=resolved.path,
            dtype=resolve_dtype(self.dtype),
            max_model_len=max_model_len,
            hf_config=hf_config,
            tokenizer=resolved.tokenizer_path,
            skip_tokenizer_init=self.skip_tokenizer_init,
            gguf_file=resolved.gguf_file,
            served_model_name=self.served_model_name,
            seed=self.seed,
            linear_dtype=self.linear_dtype,
            quantization=_checkpoint_quantization(self.quantization, resolved.gguf_file is not None, hf_config),
            runner_type="generate" if pooler is None else "pooling", pooler_config=pooler,
            max_logprobs=self.max_logprobs, max_n=self.max_n or self.max_num_seqs,
            mm_hf_config=mm_hf_config, limit_mm_per_prompt=limit_mm,
            allowed_local_media_path=self.allowed_local_media_path,
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
            gpu_memory_utilization=(self.gpu_memory_utilization or 0.9) if device == "cuda" else None,
        )
        scheduler_config = SchedulerConfig(
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            max_passed_over=self.scheduling_max_passed_over,
            staging_size=self.scheduling_staging_size,
            async_scheduling=self.async_scheduling,
            disable_chunked_mm_input=_whole_image_steps(mm_hf_config, max_batched),
        )
        if spec_config is not None and spec_config.method == "draft_model" and spec_config.model is not None:
            draft = EngineArgs(model=spec_config.model, dtype=str(model_config.dtype).removeprefix("torch."),
                               max_model_len=max_model_len).create_engine_config().model_config
            spec_config = dataclasses.replace(spec_config, draft_model_config=draft)
        config = EngineConfig(model_config, cache_config, scheduler_config,
                              num_threads=self.num_threads, log_stats=not self.disable_log_stats,
                              attention_backend=self.attention_backend, profile=self.profile,
                              # (batch-invariant: off, its exact recheck sums in another order than the head)
                              greedy_head_screen=(self.greedy_head_screen and not self.batch_invariant
                                                  and pooler is None),
                              structured_outputs_config=so_config,
                              speculative_config=spec_config, lora_config=lora_config,
                              batch_invariant=self.batch_invariant, data_parallel_config=dp_config,
                              parallel_config=parallel_config, kv_transfer_config=kv_transfer_config,
                              device_config=DeviceConfig(device, self.worker_cls, self.enforce_eager))
        current_platform.check_and_update_config(config)
        return config

    def create_data_parallel_config(self) -> DataParallelConfig:
        """The data-parallel part of the arguments (validated)."""
        return DataParallelConfig(self.data_parallel_size, self.dp_routing, self.dp_imbalance_threshold)


    def create_structured_outputs_config(self) -> StructuredOutputsConfig:
        """StructuredOutputsConfig from --structured-outputs-config merged with --structured-outputs-backend and
        --reasoning-parser (a field set both ways must agree; ValueError naming it)."""
        fields_ = structured_outputs_fields(self.structured_outputs_config)
        for name, flag_value, default in (("backend", self.structured_outputs_backend, "auto"),
                                          ("reasoning_parser", self.reasoning_parser, None)):
            if name in fields_ and flag_value != default and fields_[name] != flag_value:
                raise ValueError(f"structured_outputs_config.{name} ({fields_[name]!r}) disagrees with "
                                 f"{'structured_outputs_backend' if name == 'backend' else name} ({flag_value!r}).")
            fields_.setdefault(name, flag_value)
        parser = fields_["reasoning_parser"]
        return StructuredOutputsConfig(**fields_, **_reasoning_strings(self.reasoning_config, parser))


STRUCTURED_OUTPUTS_CONFIG_KEYS = ("backend", "disable_fallback", "disable_any_whitespace",
                                  "disable_additional_properties", "reasoning_parser", "reasoning_parser_plugin",
                                  "enable_in_reasoning")


def structured_outputs_fields(value: Any) -> dict[str, Any]:
    """vLLM's structured_outputs_config (a dict, its JSON text, or a config object with those attributes) as
    StructuredOutputsConfig's fields; a ValueError names an unknown key or a bad value."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):  # vLLM's / our StructuredOutputsConfig object: its known attributes
        value = {k: getattr(value, k) for k in STRUCTURED_OUTPUTS_CONFIG_KEYS if hasattr(value, k)}
    unknown = [k for k in value if k not in STRUCTURED_OUTPUTS_CONFIG_KEYS]
    if unknown:
        raise ValueError(f"structured_outputs_config: unknown key(s) {', '.join(map(str, unknown))} "
                         f"(known: {', '.join(STRUCTURED_OUTPUTS_CONFIG_KEYS)}).")
    out = dict(value)
    if out.pop("reasoning_parser_plugin", "") not in ("", None):
        raise ValueError("structured_outputs_config.reasoning_parser_plugin: reasoning parser plugins are not "
                         "supported; pick a built-in reasoning_parser.")
    if "reasoning_parser" in out:
        out["reasoning_parser"] = out["reasoning_parser"] or None  # vLLM's default is ""
        if out["reasoning_parser"] is not None and out["reasoning_parser"] not in reasoning_parser_names():
            raise ValueError(f"structured_outputs_config.reasoning_parser must be one of "
                             f"{', '.join(reasoning_parser_names())}, got {out['reasoning_parser']!r}.")
    if "backend" in out and out["backend"] not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(f"structured_outputs_config.backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}"
                         f", got {out['backend']!r}.")
    for k, v in out.items():
        if k.startswith(("disable_", "enable_")) and not isinstance(v, bool):
            raise ValueError(f"structured_outputs_config.{k} must be a boolean, got {v!r}.")
    return out


def _check_structured_outputs_config(value: dict[str, Any]) -> None:
    structured_outputs_fields(value)


def resolve_device(device: str) -> str:
    """The torch device type for a `device` argument: auto is the process's platform; an explicit one must be it
    (the platform is chosen once per process, by $PAGEMILL_DEVICE)."""
    device = (device or "auto").strip().lower()
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be one of auto, cpu, cuda; got {device!r}.")
    if device != "auto" and device != current_platform.device_type:
        if device == "cuda":
            raise ValueError("device='cuda': this process runs on the CPU platform (no CUDA device is visible, or "
                             "PAGEMILL_DEVICE=cpu); set PAGEMILL_DEVICE=cuda on a machine with a GPU.")
        raise ValueError(f"device={device!r}: this process runs on the {current_platform.device_name} platform; set "
                         f"PAGEMILL_DEVICE={device} before pagemill is imported.")
    return current_platform.device_type


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
    quantized_checkpoint = not gguf and _checkpoint_quantization(args.quantization, False,
                                                                 hf_config) in CHECKPOINT_QUANTIZATIONS
    if tp > 1 and quantized_checkpoint:
        raise ValueError(f"quantization: a quantized checkpoint's weights are not sliced over tensor-parallel ranks "
                         f"yet; use tensor_parallel_size=1 (not {tp}).")
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
    if args.batch_invariant:  # (an explicit attention_backend: the platform's check names it)
        raise ValueError("kv_cache_layout='virtual' has its own attention (SDPA over contiguous KV): it cannot be "
                         "combined with batch_invariant=True.")
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


# Config-object fields of EngineArgs and the check that builds their config (a ValueError names the field).
JSON_FIELD_VALIDATORS: dict[str, Callable[[dict[str, Any]], object]] = {
    "speculative_config": SpeculativeConfig.from_user,
    "kv_transfer_config": KVTransferConfig.from_user,
    "structured_outputs_config": _check_structured_outputs_config,
}


def _whole_image_steps(mm_hf_config: Any, max_batched: int) -> bool:
    """Whether the model's image tokens attend bidirectionally within their image (Gemma 3), so the scheduler must
    compute each image's placeholder run in one step; then one image must fit the step's token budget."""
    if mm_hf_config is None:
        return False
    from pagemill.models.registry import get_model_class

    if not getattr(get_model_class(mm_hf_config), "bidirectional_image_attention", False):
        return False
    per_image = int(getattr(mm_hf_config, "mm_tokens_per_image", 0) or 0)
    if max_batched < per_image:
        raise ValueError(f"max_num_batched_tokens ({max_batched}) must be >= the {per_image} placeholder tokens of "
                         "one image: this model's image tokens attend to their whole image, so an image is never "
                         "split over two steps.")
    return True


def _limit_mm_per_prompt(value: dict[str, Any] | str | None) -> dict[str, int] | None:
    """--limit-mm-per-prompt checked: {"image": N} (JSON text or a dict), N >= 0."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt must be JSON such as '{{\"image\": 4}}': {e}") from e
    if not isinstance(value, dict) or any(not isinstance(n, int) or isinstance(n, bool) or n < 0
                                          for n in value.values()):
        raise ValueError(f"limit_mm_per_prompt must map a modality to a count >= 0, got {value!r}.")
    unknown = set(value) - {"image"}
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: unsupported modalities {sorted(unknown)} (supported: image).")
    return dict(value)


def config_flag(name: str) -> Callable[[str], dict[str, Any]]:
    """The argparse `type` of the EngineArgs field `name` (e.g. speculative_config), with its validation."""
    return json_dict_flag(name, JSON_FIELD_VALIDATORS.get(name))


_ALIASES = {"data_parallel_size": ["-dp"], "tensor_parallel_size": ["-tp"],  # vLLM's short flags
            "pipeline_parallel_size": ["-pp"]}
_CHOICES = {"dp_routing": DP_ROUTING_POLICIES, "reasoning_parser": reasoning_parser_names()}
_CUSTOM = {"served_model_name"}  # declared by hand (several names allowed)


def _scalar_type(tp: object) -> type:
    """int/float/str for an annotation such as `int | None`; a union with str parses as str."""
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union \
        else (tp,)
    args = tuple(a for a in args if a is not type(None))
    if str in args or len(args) != 1:
        return str
    return args[0] if args[0] in (int, float, str) else str


def _is_dict_field(tp: object) -> bool:
    """Whether an annotation such as `dict[str, Any] | str | None` admits a dict (a JSON-object flag)."""
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union \
        else (tp,)
    return any(a is dict or typing.get_origin(a) is dict for a in args)


def _reasoning_strings(config: dict[str, Any] | str | None, parser: str | None) -> dict[str, str | None]:
    """--reasoning-config as StructuredOutputsConfig's fields (ValueError naming it for a bad one)."""
    if parser is not None and parser not in reasoning_parser_names():
        raise ValueError(f"reasoning_parser must be one of {', '.join(reasoning_parser_names())}, got {parser!r}.")
    if config is None:
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as e:
            raise ValueError(f"reasoning_config is not valid JSON: {e}") from e
    known = ("reasoning_start_str", "reasoning_end_str")
    if isinstance(config, dict):  # vLLM's older names: think_start_str / think_end_str
        config = {k.replace("think_", "reasoning_", 1) if k.startswith("think_") else k: v for k, v in config.items()}
    if not isinstance(config, dict) or any(k not in known for k in config):
        raise ValueError(f"reasoning_config must be an object with the fields {', '.join(known)}, got {config!r}.")
    if parser is None:
        raise ValueError("reasoning_config needs --reasoning-parser.")
    return {k: config.get(k) for k in known}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field (`--max-num-seqs`, `--enable-prefix-caching/--no-...`)."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name in _CUSTOM:
            continue
        flag = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "")
        if hints[f.name] is bool:
            group.add_argument(*flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif _is_dict_field(hints[f.name]):
            group.add_argument(*flag, type=config_flag(f.name), default=default, metavar="JSON", help=help_text)
        else:
            group.add_argument(*flag, type=_scalar_type(hints[f.name]), default=default,
                               choices=_CHOICES.get(f.name), help=help_text)


def _checkpoint_quantization(quantization: str, from_gguf: bool, hf_config: Any) -> str:
    """The resolved quantization; a checkpoint's quantization_config is checked field by field here (ValueError
    naming the field) so a bad one fails before any weight is read."""
    qc = None if from_gguf else getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict) and hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    method = None
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else type(qc).__name__
    resolved = resolve_quantization(quantization, from_gguf, method)
    if resolved == "gguf" and quantization == "auto" and "gguf" not in current_platform.supported_quantization:
        resolved = "none"  # no kernels for GGUF's blocks on this device (CUDA): dequantized at load, to the dtype
    if resolved in CHECKPOINT_QUANTIZATIONS:
        from pagemill.layers.quantization.checkpoint_formats import parse_checkpoint_quant

        parse_checkpoint_quant(qc)
    return resolved
