"""Offline throughput on the GPU, nano-vllm's workload: 256 sequences, input and output lengths uniform in
100..1024, ignore_eos, random token ids, a random-weight Llama-3.2-1B-shaped model in bfloat16 built on the GPU from
its config. Prints pagemill's output tok/s (CUDA graphs; and eager when --eager-too), the run's roofline (weight + KV
bytes per decode step over the measured HBM bandwidth, plus prefill FLOPs over the measured bf16 GEMM rate) and HF
transformers `generate` on a subset, then one summary row (THROUGHPUT ...).
`--dry-run`: a tiny model and 4 short sequences on the CPU with the GPU worker (Triton interpreter)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build, report, save, shape_counts  # noqa: E402


def measure_bandwidth() -> float:
    """HBM copy bandwidth, bytes/s (read + write of a 2 GiB buffer)."""
    x = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - t)


def measure_gemm() -> float:
    """bf16 GEMM rate, FLOP/s (8192^3)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t)


def roofline_seconds(ins: list[int], outs: list[int], weight_bytes: int, kv_per_token: int, bw: float,
                     params: int, flops: float) -> float:
    """Lower bound of the run's time: every decode step reads the weights once and every active sequence's KV
    (all sequences in flight together), prefill at the GEMM rate."""
    t = 2 * params * sum(ins) / flops
    for step in range(1, max(outs) + 1):
        kv = sum(i + step for i, o in zip(ins, outs) if o >= step) * kv_per_token
        t += (weight_bytes + kv) / bw
    return t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--hf-subset", type=int, default=16)
    ap.add_argument("--eager-too", action="store_true")
    ap.add_argument("--async-too", action="store_true", help="also with async_scheduling=True")
    ap.add_argument("--virtual-too", action="store_true",
                    help="also with kv_cache_layout='virtual' (vTensor: CUDA VMM ranges, one 2 MiB chunk per block)")
    ap.add_argument("--profile", action="store_true",
                    help="after the runs: torch.profiler over 64 of the requests (32 output tokens), top kernels")
    ap.add_argument("--root", default="/tmp/pagemill-gpu/models")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dry = args.dry_run
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from pagemill import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    n, lo, hi = (4, 5, 12) if dry else (args.num_seqs, 100, 1024)
    ins = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    outs = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    t0 = time.perf_counter()
    if dry:
        path = build("llama", args.root)
        vocab = 512
        engine = dict(worker_cls="pagemill.worker.gpu_worker.GpuWorker", attention_backend="triton",
                      kv_cache_memory="16MiB", max_model_len=64, dtype="float32")
    else:
        path = build("llama-1b", args.root, dtype=torch.bfloat16, device="cuda")
        vocab = 128256
        engine = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384,
                      gpu_memory_utilization=0.9)
    print(f"model built/saved in {time.perf_counter() - t0:.1f}s: {path}", flush=True)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (i,), generator=g).tolist()} for i in ins]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    results = {}
    variants = [("graphs", {}), *([("async", {"async_scheduling": True})] if args.async_too else []),
                *([("eager", {"enforce_eager": True})] if args.eager_too else []),
                # a chunk is one block of one layer's K: 2 MiB (the driver's granularity) = 2,048 tokens of the 1B's
                # bf16 K (8 heads x 64); the tiny float32 model's 4 KiB host page = 32 tokens
                *([("virtual", {"kv_cache_layout": "virtual", "block_size": 32 if dry else 2048})]
                  if args.virtual_too else [])]
    for label, over in variants:
        t0 = time.perf_counter()
        try:
            llm = LLM(path, **engine, **over)
        except Exception as exc:  # noqa: BLE001 (a variant that cannot start is reported; the others stand)
            print(f"pagemill {label}: FAILED to start: {type(exc).__name__}: {exc}", flush=True)
            continue
        load = time.perf_counter() - t0
        llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)  # warm-up
        if not dry:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        if not dry:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        got = sum(len(r.outputs[0].token_ids) for r in res)
        assert got == sum(outs), (got, sum(outs))
        results[label] = dict(seconds=secs, tok_s=got / secs, load_s=load)
        print(f"pagemill {label}: {got} output tokens in {secs:.1f}s = {got / secs:,.0f} tok/s (engine start "
              f"{load:.1f}s)", flush=True)
        if args.profile and label == "graphs" and not dry:
            profile(llm, prompts[:64])
        del llm, res
        gc.collect()
        if not dry:
            torch.cuda.empty_cache()
    row = {"card": "cpu (dry run)" if dry else torch.cuda.get_device_name(0), "num_seqs": n,
           "output_tokens": sum(outs), **{f"{k}_tok_s": v["tok_s"] for k, v in results.items()}}
    if not dry:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path)
        per_layer, emb, kv_elems = shape_counts(cfg)
        params_n = emb + cfg.num_hidden_layers * per_layer  # (tied head: read once per step as the LM head)
        weight_bytes = 2 * params_n
        kv_per_token = 2 * kv_elems
        bw, flops = measure_bandwidth(), measure_gemm()
        floor = roofline_seconds(ins, outs, weight_bytes, kv_per_token, bw, params_n, flops)
        roof = sum(outs) / floor
        row.update(hbm_gb_s=bw / 1e9, gemm_tflops=flops / 1e12, roofline_tok_s=roof,
                   pct_of_roofline=results["graphs"]["tok_s"] / roof)
        print(f"HBM {bw / 1e9:,.0f} GB/s, bf16 GEMM {flops / 1e12:,.0f} TFLOP/s: roofline {roof:,.0f} tok/s; "
              f"pagemill at {results['graphs']['tok_s'] / roof:.1%} of it", flush=True)
        save(row, args.json)  # (kept if HF's run fails)
        try:
            row["hf_tok_s"] = hf_generate(path, ins, outs, args.hf_subset, vocab)
        except Exception as exc:  # noqa: BLE001 (the table says so; pagemill's numbers stand)
            print(f"HF generate failed: {type(exc).__name__}: {exc}", flush=True)
    report("THROUGHPUT", row, args.json)
    return 0


def profile(llm, prompts: list[dict]) -> None:
    """torch.profiler over a short run (64 requests, 32 output tokens): the GPU's busy share of the wall time and
    the kernels that took most of it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from pagemill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e6
    print(f"profile: wall {wall * 1e3:.0f} ms, GPU kernels {gpu * 1e3:.0f} ms ({gpu / wall:.0%} busy)", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60), flush=True)


def hf_generate(path: str, ins: list[int], outs: list[int], subset: int, vocab: int) -> float:
    """HF transformers generate (bf16, SDPA, one batch, left-padded to the longest prompt, the subset's shortest
    output length for every row so no row idles): output tok/s."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    n_in, n_out = max(ins[:subset]), min(256, min(outs[:subset]))
    ids = torch.randint(3, vocab, (subset, n_in), device="cuda")
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_out,
                    min_new_tokens=n_out, pad_token_id=0)
    torch.cuda.synchronize()
    tok_s = subset * n_out / (time.perf_counter() - t0)
    print(f"HF generate: {subset} x ({n_in} in, {n_out} out) = {tok_s:,.0f} tok/s", flush=True)
    del hf
    torch.cuda.empty_cache()
    return tok_s


if __name__ == "__main__":
    sys.exit(main())
