"""The records GEMV on a Llama-3.2-1B's largest shapes, float32 (exact) or int8 activations, in T ops/s.

gate_up (2048 -> 16384) as Q4_K and down (8192 -> 2048) as Q6_K, the formats a Q4_K_M file gives them, at 32 rows
(a batched decode step) and 512 (a prefill chunk). Random blocks (only the layout and the bytes matter); the best of
three timed rounds per case. Run it with nothing else on the machine.

    python benchmarks/kernels_i8_records.py [--exact] [--ms 32,512]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagemill.kernels.build import load_kernels
from pagemill.layers.quantization.gguf import pack_records
from pagemill.layers.quantization.gguf_records import PLANE_LAYOUTS

SHAPES = [("q4_k", 16384, 2048), ("q6_k", 2048, 8192)]  # (format, N, K)


D_OFFSETS = {"q4_k": (0, 2), "q6_k": (208,)}  # the blocks' fp16 d / dmin bytes (gguf.quants cannot quantize these)


def random_blocks(fmt: str, n: int, k: int) -> torch.Tensor:
    """Random blocks uint8 [n, k / block, bytes] with small positive fp16 d / dmin."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    length, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt.upper()]]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n, k // length, nbytes), dtype=np.uint8)
    for o in D_OFFSETS[fmt]:
        raw[..., o:o + 2] = (rng.random((n, k // length)) * 0.01 + 1e-3).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(n, k // length, nbytes)


def main() -> None:
    """Print each (shape, rows) case's time and T ops/s (2 M N K / time)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exact", action="store_true", help="float32 activations (the default path), not int8")
    ap.add_argument("--ms", default="32,512", help="row counts")
    args = ap.parse_args()
    kernels = load_kernels()
    for fmt, n, k in SHAPES:
        kind, records = pack_records([(fmt, random_blocks(fmt, n, k))], kernels.isa())
        for m in (int(v) for v in args.ms.split(",")):
            x, out = torch.randn(m, k), torch.empty(m, n)

            def call() -> None:
                kernels.gemv_records(out, x, records, PLANE_LAYOUTS[kind][3], None, int8_activations=not args.exact)

            for _ in range(3):
                call()
            reps, best = max(3, int(2e10 / (m * n * k))), float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(reps):
                    call()
                best = min(best, (time.perf_counter() - t) / reps)
            print(f"{fmt} N={n} K={k} M={m}: {best * 1e3:.2f} ms  {2 * m * n * k / best / 1e12:.3f} T ops/s")


if __name__ == "__main__":
    main()
