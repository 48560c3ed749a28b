"""Why int8 top-1 agreement stops short of 99%: agreement against the weight error, and float32's margins at flips.

Each variant replaces the decoder linears of an HF directory (from benchmarks/quant_accuracy.py's GGUF directories,
or --hf-dir) by their values under a weight format, and the float32 engine reads the corpus on that copy against the
original (the GEMV path computes F.linear of the dequantized weight, so int8 rows equal the engine's). Variants:
int8 fits (GROUP-GRID-FIT, e.g. 32-sym-plain: the former format, 16-asym-search: the current one), bf16w (weights
rounded to bfloat16, activations float32), noiseX (Gaussian noise of X% of each tensor's rms). Per variant: relative
rms weight error, top-1 agreement, mean |delta logprob|, and the float32 top-1 / top-2 logprob margins where the
top-1 flipped. Accuracy, not a timing.

    python benchmarks/quant_error_scaling.py --hf-dir DIR [VARIANT ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from pagemill.benchmarks.quant_accuracy import compare, corpus_paragraphs, prompt_topk
from pagemill.layers.quantization.int8_grid import dequantize_int8, quantize_int8

DEFAULT_VARIANTS = ["32-sym-plain", "16-asym-search", "bf16w", "noise0.1", "noise0.2", "noise0.35", "noise0.55"]
MARGINS = (0.01, 0.02, 0.05, 0.1, 0.2)  # nats: share of positions whose float32 top-1 / top-2 margin is below


def weight_map(variant: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The float weight -> its values under `variant` (see the module docstring)."""
    if variant == "bf16w":
        return lambda w: w.bfloat16().float()
    if variant.startswith("noise"):
        rel, gen = float(variant[5:]) / 100, torch.Generator().manual_seed(0)
        return lambda w: w + torch.randn(w.shape, generator=gen) * w.square().mean().sqrt() * rel
    group, grid, fit = variant.split("-")
    return lambda w: dequantize_int8(quantize_int8(w, int(group), grid == "asym", fit == "search"))


def mapped_dir(src: str, out: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """A copy of HF directory `src` at `out` with fn applied to the decoder linears; their relative rms change."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    err = norm = 0.0
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            sd = load_file(os.path.join(src, f))
            for k, v in sd.items():
                if ".layers." in k and v.dim() == 2 and v.shape[1] % 32 == 0:
                    sd[k] = fn(v).contiguous()
                    err, norm = err + float((sd[k] - v).square().sum()), norm + float(v.square().sum())
            save_file(sd, os.path.join(out, f), metadata={"format": "pt"})
    return (err / max(norm, 1e-30)) ** 0.5


def top_margins(ref: list[list[dict[int, float]]]) -> list[float]:
    """float32's top-1 minus top-2 logprob at every position."""
    out = []
    for seq in ref:
        for r in seq:
            a, b = sorted(r.values(), reverse=True)[:2]
            out.append(a - b)
    return out


def flip_margins(ref: list[list[dict[int, float]]], other: list[list[dict[int, float]]],
                 margins: list[float]) -> list[float]:
    """float32's margin at each position where `other`'s top-1 differs."""
    flips = [max(o, key=o.get) != max(r, key=r.get) for rs, os_ in zip(ref, other) for r, o in zip(rs, os_)]
    return sorted(m for m, f in zip(margins, flips) if f)


def main() -> None:
    """Print the margin distribution, then one row per variant."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="HF safetensors directory (float32 weights)")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("variants", nargs="*", default=DEFAULT_VARIANTS)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    token_lists = [tok.encode(p) for p in corpus_paragraphs()]
    ref = prompt_topk(args.hf_dir, token_lists, args.chunk)
    margins = top_margins(ref)
    print(f"{len(margins)} positions; float32 top-1/top-2 margin below " +
          ", ".join(f"{t}: {sum(m < t for m in margins) / len(margins):.2%}" for t in MARGINS))
    print(f"{'variant':<16} {'weight err':>10} {'top-1 agree':>11} {'mean |dlp|':>10} {'flips':>5} "
          f"{'median margin':>13} {'max margin':>10}")
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as tmp:
            rel = mapped_dir(args.hf_dir, os.path.join(tmp, "m"), weight_map(variant))
            other = prompt_topk(os.path.join(tmp, "m"), token_lists, args.chunk)
        a, flips = compare(variant, ref, other), flip_margins(ref, other, margins)
        print(f"{variant:<16} {rel:>10.3%} {a.top1_agreement:>11.2%} {a.mean_abs_dlogprob:>10.4f} {len(flips):>5} "
              f"{statistics.median(flips or [0.0]):>13.3f} {max(flips, default=0.0):>10.3f}", flush=True)


if __name__ == "__main__":
    main()
