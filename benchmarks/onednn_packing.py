"""Linear layers of a whole SmolLM2 step (30 layers + LM head): F.linear vs oneDNN with weights reordered once.

    python benchmarks/onednn_packing.py --dtype float16 --rows 8,32,64,128

Every layer has its own weights, so the weights stream from memory as in the engine (not one hot matrix).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of qkv, o, gate_up, down
LAYERS = 30


def best_of(fn, repeats: int = 5) -> float:
    """Fastest of `repeats` timed calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    """Print ms and GFLOP/s per step for each row count."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--rows", default="8,32,64,128")
    ap.add_argument("--hint", type=int, default=32, help="batch-size hint given to the oneDNN reorder")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [[(torch.randn(n, k) / k**0.5).to(dtype) for k, n in SHAPES] for _ in range(LAYERS)]
    head = (torch.randn(49152, 576) / 24).to(dtype)
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, args.hint) for w in ws] for ws in weights]
    packed_head = torch.ops.mkldnn._reorder_linear_weight(head, args.hint)
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).to(dtype) for k, _ in SHAPES}

        def plain() -> None:
            for ws in weights:
                for (k, _), w in zip(SHAPES, ws):
                    F.linear(xs[k], w)
            F.linear(xs[576], head)

        def prepacked() -> None:
            for ps in packed:
                for (k, _), p in zip(SHAPES, ps):
                    torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
            torch.ops.mkldnn._linear_pointwise(xs[576], packed_head, None, "none", [], "")

        flops = 2 * m * (LAYERS * sum(k * n for k, n in SHAPES) + 576 * 49152)
        a, b = best_of(plain), best_of(prepacked)
        print(f"{args.dtype} rows {m:4d}: F.linear {a * 1e3:6.1f} ms ({flops / a / 1e9:5.0f} GFLOP/s), "
              f"oneDNN prepacked {b * 1e3:6.1f} ms ({flops / b / 1e9:5.0f} GFLOP/s): {a / b:.2f}x")


if __name__ == "__main__":
    main()
