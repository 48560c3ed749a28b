"""Paged-attention kernel microbenchmark: decode of a batch over long contexts, fp32 vs fp16 KV cache.

    python benchmarks/attention_kernel.py --batch 32 --context 512

Prints ms per layer, x30 layers (SmolLM2), effective KV GB/s and ns per (token, KV head, key).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagemill.kernels import load_kernels


def main() -> None:
    """Time the kernel on a synthetic cache laid out as the engine lays it out (one block table per request)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_kernels()
    b, ctx, hq, hk, d, bs = args.batch, args.context, 9, 3, 64, 16
    per_req = ctx // bs + 1
    nb = b * per_req + 1
    for dtype in (torch.float32, torch.float16):
        k_cache = torch.randn(nb, bs, hk, d).to(dtype)
        v_cache = torch.randn(nb, bs, hk, d).to(dtype)
        table = torch.arange(1, nb).view(b, per_req).long().contiguous()
        q, out = torch.randn(b, hq, d), torch.empty(b, hq, d)
        qsl, lens = torch.arange(b + 1).long(), torch.full((b,), ctx).long()

        def run() -> None:
            kernels.paged_attention(out, q, k_cache, v_cache, table, qsl, lens, d**-0.5, 0)

        for _ in range(3):
            run()
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        sec = sorted(times)[len(times) // 2]
        keys = b * (ctx + 1) * hk
        print(f"{str(dtype):14s} {sec * 1e3:6.3f} ms/layer, x30 = {sec * 30e3:6.1f} ms; "
              f"{keys * d * 2 * k_cache.element_size() / sec / 1e9:5.1f} GB/s; {sec / keys * 1e9:5.1f} ns/key-head")


if __name__ == "__main__":
    main()
