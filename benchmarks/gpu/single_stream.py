"""Single-stream decode on the GPU: a random-weight Llama-3.1-8B-shaped model in bfloat16 (built on the GPU from its
config), one request of 128 prompt tokens and 512 output tokens (ignore_eos), with CUDA graphs and without them (the
same engine, its graphs set aside), then with async scheduling, against the HBM bound: the bytes every decode step
must read (all weights but the embedding table, plus the request's KV) over the measured copy bandwidth. Prints one
row (SINGLE ...). `--dry-run`: a tiny model on the CPU with the GPU worker (Triton interpreter)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build, report, shape_counts  # noqa: E402
from throughput import measure_bandwidth  # noqa: E402


def decode_bytes(cfg, context: int) -> int:
    """Bytes one decode step reads at `context` tokens: every weight but the embedding table (bf16) and the KV."""
    per_layer, lm_head, kv_elems = shape_counts(cfg)
    return 2 * (cfg.num_hidden_layers * per_layer + lm_head + context * kv_elems)


def time_decode(llm, prompt: dict, n_out: int, label: str) -> tuple[float, float]:
    """(TPOT ms, tok/s) of one request of `n_out` tokens: its time less the time to its first token, over the
    remaining tokens (after a warm-up request)."""
    from pagemill import SamplingParams

    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True), use_tqdm=False)
    secs = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == n_out
    tpot = (secs - ttft) / max(1, n_out - 1)
    print(f"{label}: {n_out} tokens in {secs:.2f}s, TPOT {tpot * 1e3:.2f} ms = {1 / tpot:,.0f} tok/s", flush=True)
    return tpot * 1e3, 1 / tpot


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--root", default="/tmp/pagemill-gpu/models")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dry = args.dry_run
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from transformers import AutoConfig

    from pagemill import LLM

    t0 = time.perf_counter()
    if dry:
        path, n_in, n_out = build("llama", args.root), 8, 6
        engine = dict(worker_cls="pagemill.worker.gpu_worker.GpuWorker", attention_backend="triton",
                      kv_cache_memory="16MiB", max_model_len=64, dtype="float32")
    else:
        path, n_in, n_out = build("llama-8b", args.root, dtype=torch.bfloat16, device="cuda"), args.input_len, \
            args.output_len
        engine = dict(dtype="bfloat16", max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.9)
    print(f"model built/saved in {time.perf_counter() - t0:.1f}s: {path}", flush=True)
    if not dry:
        torch.cuda.empty_cache()
    prompt = {"prompt_token_ids": torch.randint(3, 500, (n_in,), generator=torch.Generator().manual_seed(0)).tolist()}
    row = {"card": "cpu (dry run)" if dry else torch.cuda.get_device_name(0), "input_len": n_in, "output_len": n_out}
    # the default engine (CUDA graphs, then the same engine with its graphs set aside), then async scheduling
    for engine_label, over in (("", {}), ("async", {"async_scheduling": True})):
        t0 = time.perf_counter()
        llm = LLM(path, **engine, **over)
        row[f"{engine_label or 'default'}_load_s"] = time.perf_counter() - t0
        print(f"engine start {time.perf_counter() - t0:.1f}s {engine_label}", flush=True)
        runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
        graphs = runner.graphs
        for label in (("graphs", "eager") if not engine_label else (engine_label,)):
            runner.graphs = None if label == "eager" else graphs
            if label != "eager" and graphs is None:
                print("no CUDA graphs were captured: this row is eager", flush=True)
            row[f"{label}_tpot_ms"], row[f"{label}_tok_s"] = time_decode(llm, prompt, n_out, label)
        runner.graphs = graphs
        del llm, runner, graphs
        gc.collect()
        if not dry:
            torch.cuda.empty_cache()
    if not dry:
        cfg = AutoConfig.from_pretrained(path)
        bw = measure_bandwidth()
        bound_ms = decode_bytes(cfg, n_in + n_out // 2) / bw * 1e3
        row.update(hbm_gb_s=bw / 1e9, bound_tpot_ms=bound_ms)
        for label in ("graphs", "eager", "async"):
            row[f"{label}_pct_of_bound"] = bound_ms / row[f"{label}_tpot_ms"]
        print(f"HBM {bw / 1e9:,.0f} GB/s: bound {bound_ms:.2f} ms/token; graphs at {row['graphs_pct_of_bound']:.1%}, "
              f"eager at {row['eager_pct_of_bound']:.1%}, graphs + async at {row['async_pct_of_bound']:.1%}",
              flush=True)
    report("SINGLE", row, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
