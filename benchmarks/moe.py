"""One MoE feed-forward block (router + experts): pagemill's fused MoE vs a per-expert loop over all experts.

"fused" sorts the (token, expert) pairs by expert once and runs one GEMM (GEMV at decode) per active expert, all
in one torch grouped_mm call ("fused, mm loop": one torch.mm per active expert from Python instead);
"loop (all experts)" visits every expert and masks its tokens, as HF transformers' eager experts do; with
transformers installed, its own Qwen3-MoE block runs too ("hf eager", "hf grouped_mm"). Prints tokens/s (median
of the repeats) per batch size; every method's output is checked against the loop first.

    python benchmarks/moe.py [--experts 8] [--top-k 2] [--hidden 512] [--inter 1024] [--batches 1,32]
                             [--repeats 7] [--min-time 0.2] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagemill.kernels.ops import select_layer_ops
from pagemill.layers.fused_moe import fused_experts, select_experts


def loop_all_experts(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                     renormalize: bool) -> torch.Tensor:
    """The per-expert loop: every expert in turn, over the tokens that picked it (none: an empty GEMM)."""
    weights, ids = select_experts(F.linear(x, router), top_k, renormalize)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, rank = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        out.index_add_(0, token, F.linear(F.silu(gate) * up, w2[e]) * weights[token, rank, None])
    return out


def _time_ms(fn: Callable[[], torch.Tensor], repeats: int, min_time: float) -> float:
    """Median over `repeats` of the mean wall time (ms) of fn() in a loop of at least min_time seconds."""
    samples = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        samples.append(dt / n * 1e3)
    return statistics.median(samples)


def _hf_blocks(args: argparse.Namespace, router: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """transformers' Qwen3-MoE block with our weights, per experts implementation (none without transformers)."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError:
        return {}
    out = {}
    for impl in ("eager", "grouped_mm"):
        config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter, num_experts=args.experts,
                                num_experts_per_tok=args.top_k, norm_topk_prob=True)
        config._experts_implementation = impl
        try:
            block = Qwen3MoeSparseMoeBlock(config).eval()
        except Exception:  # noqa: BLE001 - an implementation this transformers lacks is just left out
            continue
        with torch.no_grad():
            block.gate.weight.copy_(router)
            block.experts.gate_up_proj.copy_(w13)
            block.experts.down_proj.copy_(w2)
        out[f"hf {impl}"] = lambda x, b=block: b(x.unsqueeze(0)).squeeze(0)
    return out


def main() -> None:
    """Parse the shape, run every method at every batch size, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    router = torch.randn(e, h) * h**-0.5
    w13 = torch.randn(e, 2 * i, h) * h**-0.5
    w2 = torch.randn(e, h, i) * i**-0.5
    act = select_layer_ops("cpu").silu_and_mul

    def fused(x: torch.Tensor, grouped_mm: bool = True) -> torch.Tensor:
        weights, ids = select_experts(F.linear(x, router), args.top_k, True)
        return fused_experts(x, w13, w2, weights, ids, act, grouped_mm)

    methods = {"fused": fused, "fused, mm loop": lambda x: fused(x, grouped_mm=False),
               "loop (all experts)": lambda x: loop_all_experts(x, router, w13, w2, args.top_k, True),
               **_hf_blocks(args, router, w13, w2)}
    print(f"MoE block: {e} experts, top-{args.top_k}, hidden {h}, expert intermediate {i}, "
          f"{torch.get_num_threads()} threads; tokens/s (median of {args.repeats})")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{'method':<20}" + "".join(f"{f'batch {b}':>14}" for b in batches))
    rows: dict[str, list[float]] = {m: [] for m in methods}
    with torch.inference_mode():
        for b in batches:
            x = torch.randn(b, h)
            ref = methods["loop (all experts)"](x)
            for name, fn in methods.items():
                torch.testing.assert_close(fn(x), ref, rtol=1e-4, atol=1e-4)
                rows[name].append(b / _time_ms(lambda fn=fn: fn(x), args.repeats, args.min_time) * 1e3)
    for name, vals in rows.items():
        print(f"{name:<20}" + "".join(f"{v:>14,.0f}" for v in vals))
    base = rows["loop (all experts)"]
    print(f"{'fused speed-up':<20}" + "".join(f"{f / l:>13.2f}x" for f, l in zip(rows["fused"], base)))


if __name__ == "__main__":
    main()
