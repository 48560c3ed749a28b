"""Serving on the GPU: `pagemill serve` on a random-weight Llama-3.2-1B-shaped model (bf16, built on the GPU from its
config), `pagemill bench serve` with ShareGPT-like lengths and Poisson arrivals at a sweep of rates on loopback, and
the highest rate whose p99 TPOT stays under 50 ms. Prints one row (SERVE ...).
`--dry-run`: the tiny model on the CPU (CPU worker), two low rates, a few prompts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build, report  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--root", default="/tmp/pagemill-gpu/models")
    ap.add_argument("--rates", default="16,64,128,256")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pagemill.benchmarks.llama_cpp import ManagedServer, free_port

    t0 = time.perf_counter()
    if args.dry_run:
        path, rates, n = build("llama", args.root), "1,2", 6
        serve_args = ["--max-model-len", "512", "--kv-cache-memory", "64MiB"]
    else:
        path, rates, n = build("llama-1b", args.root, dtype=torch.bfloat16, device="cuda"), args.rates, \
            args.num_prompts
        torch.cuda.empty_cache()
        serve_args = ["--max-model-len", "4096", "--max-num-seqs", "256", "--gpu-memory-utilization", "0.85"]
    print(f"model built/saved in {time.perf_counter() - t0:.1f}s: {path}", flush=True)
    port = free_port()
    cli = [sys.executable, "-m", "pagemill.entrypoints.cli"]
    server = ManagedServer([*cli, "serve", "--model", path, "--host", "127.0.0.1", "--port", str(port),
                            *serve_args], port, "pagemill serve", ready_path="/health", timeout_s=300)
    result = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pagemill-gpu-serve-{port}.json")
    with server:
        print(f"server up in {time.perf_counter() - t0:.1f}s (log {server.log_path})", flush=True)
        bench = [*cli, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", path,
                 "--dataset-name", "sharegpt", "--num-prompts", str(n), "--sweep-rates", rates, "--ignore-eos",
                 "--disable-tqdm", "--save-result", result]
        rc = subprocess.run(bench, check=False).returncode
    if rc != 0 or not os.path.exists(result):
        print(f"bench serve failed (rc {rc}); server log tail:", flush=True)
        with open(server.log_path, encoding="utf-8", errors="replace") as f:
            print("".join(f.readlines()[-30:]), flush=True)
        return 1
    with open(result, encoding="utf-8") as f:
        runs = json.load(f)["runs"]
    row = {"card": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0), "num_prompts": n,
           "tpot_slo_ms": args.tpot_slo_ms, "rates": []}
    for r in runs:
        rate, p99 = r["request_rate"], r["tpot_ms"]["p99"]
        row["rates"].append({"request_rate": rate, "p99_tpot_ms": p99, "p99_ttft_ms": r["ttft_ms"]["p99"],
                             "output_tok_s": r.get("output_throughput")})
        print(f"rate {rate:g} req/s: p99 TPOT {p99:.1f} ms, p99 TTFT {r['ttft_ms']['p99']:.0f} ms, "
              f"output {r.get('output_throughput', 0):,.0f} tok/s", flush=True)
    ok = [x["request_rate"] for x in row["rates"] if x["p99_tpot_ms"] < args.tpot_slo_ms]
    row["best_rate"] = max(ok) if ok else None
    report("SERVE", row, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
