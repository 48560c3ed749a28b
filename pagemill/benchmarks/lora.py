"""`bench lora`: decode tok/s of a batch spread over several LoRA adapters vs the same batch on the base model.

Issue 15's multi-LoRA target: a 32-request batch over 4 adapters decodes at >= 0.8x the base model alone. The
command writes random PEFT adapters (rank `--lora-rank` on all seven projections, B != 0) for the model, loads
one engine without LoRA (the base model alone) and one with `enable_lora`, and times, ABBA over `--num-iters`:
`base` (no LoRA engine), `lora-engine-base` (the LoRA engine, no adapter in the batch: the wrappers' cost) and
`lora` (the LoRA engine, requests round-robin over the adapters). All runs are greedy and ignore_eos, so each
decodes the same number of tokens; decode tok/s excludes prefill and first tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import numpy as np
import torch

from pagemill.benchmarks.model_path import resolve_model
from pagemill.benchmarks.pagemill_backend import add_engine_args, engine_kwargs
from pagemill.benchmarks.report import check_machine_idle, config_dict, environment_info, format_table, save_result
from pagemill.benchmarks.speculative import Run, _median_run, timed_run

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench lora`."""
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32, help="requests in the batch (one wave)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    add_engine_args(parser)


def write_random_adapter(path: str, hf_config: Any, rank: int, seed: int) -> str:
    """A PEFT adapter directory for a Llama-like config: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's init), B ~ N(0,
    0.02), every layer's seven projections."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    q_out, kv_out = c.num_attention_heads * head_dim, kv * head_dim
    shapes = {"q_proj": (c.hidden_size, q_out), "k_proj": (c.hidden_size, kv_out), "v_proj": (c.hidden_size, kv_out),
              "o_proj": (q_out, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            bound = fan_in ** -0.5
            tensors[f"{prefix}.lora_A.weight"] = (torch.rand(rank, fan_in, generator=gen) * 2 - 1) * bound
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
                   "bias": "none", "use_rslora": False, "use_dora": False}, f)
    return path


def run_lora(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark, print the table, save JSON if asked."""
    from pagemill import LLM, LoRARequest
    from pagemill.benchmarks.prompts import PromptBuilder

    load = check_machine_idle()
    model = resolve_model(args.model)
    kwargs = engine_kwargs(args, model)
    kwargs.setdefault("max_num_seqs", max(args.num_prompts, 128))
    kwargs.setdefault("enable_prefix_caching", False)  # every run prefills the same prompts: no cache hits
    base = LLM(**kwargs)
    hf_config = base.llm_engine.config.model_config.hf_config
    builder = PromptBuilder(base.get_tokenizer())
    rng = np.random.default_rng(args.seed)
    prompts = [builder.build(args.input_len, rng)[1] for _ in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"adapter{i}", i + 1, write_random_adapter(os.path.join(tmp, f"adapter{i}"),
                                                                            hf_config, args.lora_rank, args.seed + i))
                    for i in range(args.num_adapters)]
        lora = LLM(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=max(16, args.lora_rank),
                   **kwargs)
        for a in adapters:
            lora.add_lora(a)
        per_request = [adapters[i % len(adapters)] for i in range(len(prompts))]
        cases = {"base": (base, None), "lora-engine-base": (lora, None), "lora": (lora, per_request)}
        runs: dict[str, list[Run]] = {name: [] for name in cases}
        for name, (llm, loras) in cases.items():  # warm-up (first-step allocations, adapter slots)
            _timed(llm, prompts[:4], 4, loras[:4] if loras else None)
        for it in range(args.num_iters):
            order = list(cases) if it % 2 == 0 else list(reversed(cases))
            for name in order:
                llm, loras = cases[name]
                runs[name].append(_timed(llm, prompts, args.output_len, loras))
    medians = {name: _median_run(r) for name, r in runs.items()}
    tps = {name: r.decode_tokens_per_s for name, r in medians.items()}
    result = {
        "config": config_dict(args), "environment": environment_info(), "load_average_before": load,
        "decode_tokens_per_s": tps,
        "decode_tokens_per_s_all": {name: [x.decode_tokens_per_s for x in r] for name, r in runs.items()},
        "lora_vs_base": tps["lora"] / tps["base"], "lora_engine_base_vs_base": tps["lora-engine-base"] / tps["base"],
        "distinct_outputs": len({tuple(o) for o in medians["lora"].outputs[:args.num_adapters]}),
    }
    print(format_table(f"LoRA: {args.num_prompts} requests, {args.num_adapters} adapters, rank {args.lora_rank}", [
        ("Base model alone (decode tok/s)", tps["base"]),
        ("LoRA engine, no adapter (decode tok/s)", tps["lora-engine-base"]),
        (f"LoRA engine, {args.num_adapters} adapters (decode tok/s)", tps["lora"]),
        ("Adapters vs base alone", result["lora_vs_base"]),
        ("LoRA engine without adapters vs base alone", result["lora_engine_base_vs_base"]),
    ]))
    if args.output_json:
        save_result(args.output_json, result)
    return result


def _timed(llm: Any, prompts: list[list[int]], output_len: int, loras: list[Any] | None) -> Run:
    """timed_run with one wave of all prompts, each with its adapter (None: the base model)."""
    return timed_run(llm, prompts, output_len, len(prompts), loras)
