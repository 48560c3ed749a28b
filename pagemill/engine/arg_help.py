"""The help text of each engine argument (EngineArgs field), shown by `--help` of every command with engine flags."""

from __future__ import annotations

ENGINE_ARG_HELP: dict[str, str] = {
    "model": "HF model directory or .gguf file (None: the embedded SmolLM2-135M-Instruct).",
    "tokenizer": "A local HF tokenizer directory (or .gguf file) to use instead of the model's own tokenizer.",
    "skip_tokenizer_init": "Start without a tokenizer (token-in / token-out, as vLLM): prompts must be token ids, "
                           "outputs carry token ids and no text.",
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
    "preemption_mode": "What a preempted request loses: recompute (its KV blocks are freed and its tokens computed "
                       "again, mostly found in the prefix cache) or swap (its blocks copied to host swap space).",
    "swap_space": "GiB of host memory for swapped-out KV blocks (preemption_mode swap).",
    "seed": "Random seed.",
    "served_model_name": "The model's name in the API (`model` field, /v1/models); None: SmolLM2-135M-Instruct for "
                         "the default model, else the model path's basename.",
    "linear_dtype": "Matmul dtype of the linear layers: auto (exact float32), float32, float16 or bfloat16 (3-4x "
                    "faster large-batch matmuls on AVX512-FP16/BF16 CPUs; top-1 agreement with float32 >= 0.99 for "
                    "float16, ~0.98 for bfloat16), or int8: activations quantized per row and block of 32 and "
                    "multiplied in integers against quantized weights (GGUF, or quantization=int8/int4; a speed "
                    "preset: teacher-forced top-1 agreement 0.97 on Gemma 3, 0.93 on SmolLM2).",
    "kv_cache_dtype": "KV-cache dtype: auto (the model dtype), float16 or bfloat16 (half the bytes attention reads, "
                      "twice the tokens the cache holds), or quantized as vLLM names it: int8, fp8 (= fp8_e4m3), "
                      "fp8_e5m2 (one byte per element plus a float32 scale per token and head: about 3.8x the "
                      "float32 tokens in the same kv_cache_memory).",
    "profile": "Time each part of the engine step (schedule, input preparation, forward, sampling, output "
               "processing) and report the per-step breakdown.",
    "num_gpu_blocks_override": "Exact number of KV blocks (testing).",
    "kv_cache_layout": "paged (blocks and block tables) or virtual (Linux: each request's KV contiguous in "
                       "reserved virtual memory, physical chunks of block_size tokens mapped on demand; vTensor).",
    "attention_backend": "auto (the platform's choice: on the CPU the compiled kernel, else the torch reference), cpu "
                         "torch, or triton (the CUDA platform's Triton kernels; on the CPU through Triton's "
                         "interpreter: slow, for checking them); kv_cache_layout virtual brings its own (leave auto).",
    "num_threads": "Torch threads of the engine core (None: all cores).",
    "disable_log_stats": "Do not log the periodic stats line.",
    "quantization": "auto (a GGUF file's own blocks, a quantized checkpoint's quantization_config.quant_method, else "
                    "none), none, gguf, gptq / awq / compressed-tensors / fp8 (what the checkpoint is), or "
                    "int8 / int4: quantize a safetensors model's linear layers at load (weight-only, per group of "
                    "16 / 32).",
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
    "structured_outputs_config": "vLLM's structured_outputs_config as JSON: backend, disable_fallback (auto tries "
                                 "no second backend), disable_any_whitespace (compact JSON), "
                                 "disable_additional_properties (schema objects get additionalProperties: false), "
                                 "reasoning_parser, enable_in_reasoning (the grammar applies to the thinking too).",
    "device": "auto (the process's platform: CUDA when a GPU is visible, else the CPU), cpu or cuda; it must agree "
              "with $PAGEMILL_DEVICE where that is set.",
    "worker_cls": "The worker class by import path (auto: the platform's). "
                  "pagemill.worker.gpu_worker.GpuWorker with attention_backend=triton runs the GPU worker's step on "
                  "the CPU (Triton's interpreter: slow, for tests).",
    "enforce_eager": "CUDA: run decode batches eagerly instead of replaying CUDA graphs.",
    "reasoning_parser": "Split a reasoning model's thinking from its answer (chat `reasoning` / `reasoning_content`, "
                        "Responses reasoning items); structured output and tool calls apply to the answer only, and "
                        "requests may set thinking_token_budget.",
    "reasoning_config": "JSON {\"reasoning_start_str\": ..., \"reasoning_end_str\": ...}: the markers the thinking "
                        "budget counts from and forces (default: the parser's, e.g. <think> and </think>).",
    "gpu_memory_utilization": "Share of GPU memory for the KV cache (CUDA platform); accepted and ignored on the CPU, "
                              "whose KV cache --kv-cache-memory sizes.",
    "runner": "generate or pooling (embeddings, scores: /v1/embeddings, /pooling, /score, /rerank); auto: pooling "
              "for BERT-like embedding and cross-encoder models, else generate.",
    "task": "vLLM's older spelling of --runner: embed, classify or score (pooling), generate.",
    "pooler_config": "Pooling as JSON, e.g. '{\"pooling_type\": \"MEAN\", \"normalize\": true}' (CLS, MEAN or LAST; "
                     "None: the model's sentence-transformers settings, else CLS for BERT and LAST for decoders).",
    "speculative_config": "Speculative decoding as JSON (vLLM's fields), e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}'; method ngram, suffix or draft_model (None: off).",
    "max_num_encoder_input_tokens": "Image placeholder tokens whose vision encoder runs one step may start (None: "
                                    "the step's token budget).",
    "limit_mm_per_prompt": "Most images one prompt may carry, as JSON: '{\"image\": 4}' (default 8).",
    "allowed_local_media_path": "Directory under which chat requests may name images by file:// URL (None: no "
                                "local files).",
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
