"""Command-line flags: engine flags generated from EngineArgs' fields, plus the server's own (vllm names)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing

from pagemill.config import DP_ROUTING_POLICIES, EngineArgs
from pagemill.entrypoints.chat_utils import BUILTIN_TEMPLATES
from pagemill.entrypoints.json_flags import config_flag
from pagemill.entrypoints.openai.cors import add_cors_args
from pagemill.entrypoints.openai.lora_modules import LoRAModulesAction
from pagemill.entrypoints.openai.server_limits import add_limit_args
from pagemill.entrypoints.openai.tool_parsers import tool_parser_names
from pagemill.loader.default_model import DEFAULT_MODEL_NAME

_ENGINE_HELP = {
    "model": "HF model directory or .gguf file (None: the embedded SmolLM2-135M-Instruct).",
    "tokenizer": "A local HF tokenizer directory (or .gguf file) to use instead of the model's own tokenizer.",
    "dtype": "Weight and activation dtype: auto (float32), float32, bfloat16, float16.",
    "max_model_len": "Context length (None: the model's).",
    "max_num_seqs": "Most sequences in one batch.",
    "max_num_batched_tokens": "Token budget of one engine step.",
    "block_size": "Tokens per KV-cache block.",
    "max_logprobs": "Most logprobs / top_logprobs / prompt_logprobs a request may ask for (-1: no limit).",
    "max_n": "Most sequences one request may ask for (n, best_of; None: max_num_seqs).",
    "kv_cache_memory": "KV-cache memory, e.g. 2GiB or 512MiB (None: 2 GiB or a quarter of free memory).",
    "enable_prefix_caching": "Reuse the KV blocks of shared prompt prefixes.",
    "prefix_caching_hash_algo": "Block hash: builtin or sha256.",
    "scheduling_policy": "fcfs, priority (lower `priority` values first), srtf (shortest remaining tokens first: "
                         "prompt left plus expected outputs, with aging) or two-level (FIFO into a staging queue, "
                         "SRTF within it).",
    "scheduling_max_passed_over": "srtf aging: a waiting request that has seen this many admissions since it was "
                                  "first queued is served before the others, in FIFO order.",
    "scheduling_staging_size": "two-level: requests moved from the FIFO queue into the SRTF staging queue at once "
                               "(only when it is empty).",
    "seed": "Random seed.",
    "num_gpu_blocks_override": "Exact number of KV blocks (testing).",
    "kv_cache_layout": "paged (blocks and block tables) or virtual (Linux: each request's KV contiguous in "
                       "reserved virtual memory, physical chunks of block_size tokens mapped on demand; vTensor).",
    "num_threads": "Torch threads of the engine core (None: all cores).",
    "disable_log_stats": "Do not log the periodic stats line.",
    "quantization": "auto (a GGUF file's own blocks, else none), none, gguf, or int8 / int4: quantize a safetensors "
                    "model's linear layers at load (weight-only, per group of 16 / 32).",
    "greedy_head_screen": "Greedy rows: int8 screen of the LM head, exact float32 recheck of the tokens that could "
                          "win (same tokens, faster batched decode).",
    "batch_invariant": "Fixed reduction orders in matmuls and attention: a request's logits (and seeded samples) "
                       "are the same bits alone, in any batch and however its prompt is chunked (slower).",
    "async_scheduling": "Schedule step N+1 while the model runs step N (at most 2 steps in flight): the engine's "
                        "non-forward work overlaps the forward. Steps with structured-output requests run "
                        "synchronously; cannot be combined with speculative decoding or tensor / pipeline "
                        "parallelism.",
    "structured_outputs_backend": "Structured output (guided decoding) library: auto (xgrammar, or llguidance for "
                                  "what xgrammar lacks), xgrammar, guidance.",
    "gpu_memory_utilization": "Accepted for vLLM scripts; no meaning on a CPU (use --kv-cache-memory).",
    "runner": "generate or pooling (embeddings, scores: /v1/embeddings, /pooling, /score, /rerank); auto: pooling "
              "for BERT-like embedding and cross-encoder models, else generate.",
    "task": "vLLM's older spelling of --runner: embed, classify or score (pooling), generate.",
    "pooler_config": "Pooling as JSON, e.g. '{\"pooling_type\": \"MEAN\", \"normalize\": true}' (CLS, MEAN or LAST; "
                     "None: the model's sentence-transformers settings, else CLS for BERT and LAST for decoders).",
    "speculative_config": "Speculative decoding as JSON (vLLM's fields), e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}'; method ngram, suffix or draft_model (None: off).",
    "enable_lora": "Serve LoRA adapters (PEFT directories) next to the base model.",
    "max_loras": "LoRA adapters one batch can mix.",
    "max_lora_rank": "The largest LoRA rank accepted.",
    "max_cpu_loras": "LoRA adapters kept loaded in memory (None: max_loras); others are reloaded from disk on use.",
    "data_parallel_size": "Engine cores (processes) behind the server, each with its own scheduler and KV cache "
                          "(--kv-cache-memory each), pinned to cores / N cores (--num-threads: threads per engine).",
    "dp_routing": "How requests pick an engine with -dp > 1: prefix-affinity (the engine that most likely holds the "
                  "prompt's prefix in its cache, unless it is overloaded) or least-loaded (waiting x 4 + running, "
                  "as vLLM).",
    "dp_imbalance_threshold": "prefix-affinity: the load score (waiting x 4 + running) by which the engine holding "
                              "the prefix may exceed the least-loaded one before the request goes to the latter.",
    "tensor_parallel_size": "Ranks (worker processes) each layer's weights, heads and KV cache are split over.",
    "pipeline_parallel_size": "Pipeline stages (worker processes) the layers are split over.",
    "distributed_executor_backend": "What runs the workers: uni (one, in the engine process), mp (one process "
                                    "per rank; the default when tensor x pipeline parallel size > 1) or ray (one "
                                    "Ray actor per rank, on the nodes of a Ray cluster).",
    "kv_transfer_config": "A KV connector as JSON (vLLM's fields), e.g. '{\"kv_connector\": \"ZmqConnector\", "
                          "\"kv_role\": \"kv_producer\", \"kv_port\": 14579}'; SharedStorageConnector or "
                          "ZmqConnector, kv_role kv_producer (prefill), kv_consumer (decode) or kv_both.",
}
_ALIASES = {"data_parallel_size": ["-dp"], "tensor_parallel_size": ["-tp"],  # vLLM's short flags
            "pipeline_parallel_size": ["-pp"]}
_CHOICES = {"dp_routing": DP_ROUTING_POLICIES}
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field (`--max-num-seqs`, `--enable-prefix-caching/--no-...`)."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name in _CUSTOM:
            continue
        flag = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = _ENGINE_HELP.get(f.name, f"EngineArgs.{f.name}")
        if hints[f.name] is bool:
            group.add_argument(*flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif _is_dict_field(hints[f.name]):
            group.add_argument(*flag, type=config_flag(f.name), default=default, metavar="JSON", help=help_text)
        else:
            group.add_argument(*flag, type=_scalar_type(hints[f.name]), default=default,
                               choices=_CHOICES.get(f.name), help=help_text)


def engine_args_from_namespace(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags (a positional MODEL wins over --model)."""
    values = {name: getattr(args, name) for name in EngineArgs.field_names() if hasattr(args, name)}
    if getattr(args, "model_tag", None):
        values["model"] = args.model_tag
    names = getattr(args, "served_model_name", None)
    values["served_model_name"] = names[0] if isinstance(names, list) else names
    return EngineArgs(**values)


def served_model_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name, else SmolLM2-135M-Instruct for the default model, else the model path's basename."""
    if args.served_model_name:
        return list(args.served_model_name)
    model = getattr(args, "model_tag", None) or args.model
    if model is None:
        return [DEFAULT_MODEL_NAME]
    return [os.path.basename(os.path.normpath(model))]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagemill serve` (named like `vllm serve`'s)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF model directory or .gguf file (None: the embedded SmolLM2-135M-Instruct).")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for all interfaces).")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument("--api-key", nargs="+", default=None,
                        help="Require 'Authorization: Bearer KEY' with one of these keys.")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) clients use in the `model` field (the first is reported).")
    server.add_argument("--chat-template", default=None,
                        help="Chat template file, inline Jinja template, or a shipped template's name: "
                             f"{', '.join(BUILTIN_TEMPLATES)} (ChatML with a tools branch, for SmolLM2).")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='Allow tool_choice="auto": the model decides, --tool-call-parser reads its calls.')
    server.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                        help="How to find tool calls in the model's text (for tool_choice=\"auto\").")
    server.add_argument("--lora-modules", nargs="+", action=LoRAModulesAction, default=None, metavar="NAME=PATH",
                        help="LoRA adapters served from start-up (needs --enable-lora): name=path or JSON "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; clients select one by "
                             "its name in `model`.")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="Serve GET /tokenizer_info (the tokenizer's configuration and chat template, as vLLM).")
    server.add_argument("--serve-tokenizer-files", action=argparse.BooleanOptionalAction, default=True,
                        help="Serve the tokenizer's files (tokenizer.json, tokenizer_config.json, chat_template.jinja; "
                             "nothing else) by the Hugging Face Hub's protocol under the served model names, so that "
                             "clients load it with HF_ENDPOINT=http://HOST:PORT.")
    add_limit_args(server)
    add_cors_args(server)
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical", "trace"])
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every request.")
    add_engine_args(parser)
    parser.set_defaults(disable_log_stats=False)  # a server logs its stats line unless told not to
