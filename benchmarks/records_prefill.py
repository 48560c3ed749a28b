"""Prefill-sized linears on the records path vs oneDNN's fp32 GEMM on a prepacked float32 copy (issue 34).

One Llama-3.2-1B layer's four linears (fused qkv, o, fused gate_up, down) at M rows: `gemv_records` over Q4_1
records (the fp32 panels beyond 16 rows) against `torch.ops.mkldnn._linear_pointwise` on the same weight reordered
once, best of 3 each; the records path is what every quantized linear now runs (there is no float copy).

    python benchmarks/records_prefill.py [M]
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch

from pagemill.kernels.build import load_kernels
from pagemill.layers.quantization.dense import mkldnn_pack

SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)]


def best_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    """Best wall time of fn() in ms after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main(m: int) -> None:
    """Print each shape's time and GF/s on both paths, then the layer's totals."""
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the compiled kernels are not built (python -m pagemill.kernels.build)")
    torch.manual_seed(0)
    totals = {"onednn": 0.0, "records": 0.0}
    for name, n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        records, _ = kernels.pack_gemv_weight_q4(w, 32)
        packed = mkldnn_pack(w)
        x, out = torch.randn(m, k), torch.empty(m, n)
        a = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        b = best_ms(lambda: kernels.gemv_records(out, x, records, "q4_1", None))
        totals["onednn"] += a
        totals["records"] += b
        gf = 2 * m * n * k / 1e6
        print(f"{name:8s} N={n:5d} K={k:5d} M={m}: oneDNN fp32 {a:7.1f} ms ({gf / a:4.0f} GF/s)   "
              f"records {b:7.1f} ms ({gf / b:4.0f} GF/s)")
    print(f"layer: oneDNN {totals['onednn']:.1f} ms, records {totals['records']:.1f} ms "
          f"({totals['onednn'] / totals['records']:.2f}x)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512)
