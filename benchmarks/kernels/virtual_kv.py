"""kv_cache_layout paged vs virtual (vTensor), one attention layer side by side: the paper's kernel figures on the CPU.

    python benchmarks/kernels/virtual_kv.py                 # decode + prefix-prefill attention, SmolLM2's shape
    python benchmarks/kernels/virtual_kv.py --threads 1 --iters 20

The two layouts in the engine (tok/s) are `pagemill bench throughput --variant paged="--kv-cache-layout paged"
--variant virtual="--kv-cache-layout virtual"` (docs/benchmarks/harness.md); KV accounting over a served run is
`pagemill bench serve --kv-metrics-plot`.

Attention (Fig. 7 / 8 of the vTensor paper): one layer of SmolLM2's shape (9 query heads, 3 KV heads of 64, fp32,
16-token blocks = chunks), each backend's full `forward` (cache write + attention), best of --iters runs, ms per
layer (x30 for the model).
Blocks are assigned in a shuffled order, as in a pool that has been used for a while; the virtual layout maps them
into each request's range first (its one-time cost per chunk is printed as "map"). Backends: `cpu` = pagemill's
compiled paged kernel (the default), `torch` = gather blocks + SDPA (the paged reference), `virtual` = SDPA on the
contiguous per-request views, no block table.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch

from pagemill.attention.backends.cpu_paged import CpuPagedAttention
from pagemill.attention.backends.torch_paged import TorchPagedAttention
from pagemill.attention.backends.virtual_contiguous import VirtualContiguousAttention
from pagemill.attention.metadata import CommonAttentionMetadata
from pagemill.worker.virtual_kv import VirtualKVSpace

HQ, HK, D, BS = 9, 3, 64, 16


def _best_time(fn, iters: int) -> float:
    """The fastest of `iters` runs after a warm-up (the least disturbed by other processes on a shared machine)."""
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _case(batch: int, ctx: int, new: int, iters: int, seed: int = 0) -> dict[str, float]:
    """ms per layer of each backend for `batch` requests with `ctx` cached tokens and `new` tokens each."""
    rng = np.random.default_rng(seed)
    seq = ctx + new
    per_req = -(-seq // BS)
    num_blocks = batch * per_req + 1
    table = (rng.permutation(num_blocks - 1) + 1).reshape(batch, per_req).astype(np.int64)
    rows = np.arange(batch, dtype=np.int64)
    counts = np.full(batch, new, dtype=np.int64)
    computed = np.full(batch, ctx, dtype=np.int64)
    positions = (computed[:, None] + np.arange(new)[None, :]).reshape(-1)
    req = np.repeat(rows, new)
    slots = torch.from_numpy(table[req, positions // BS] * BS + positions % BS)
    common = CommonAttentionMetadata(
        num_reqs=batch, num_decodes=batch if new == 1 else 0, num_actual_tokens=batch * new,
        query_start_loc=np.concatenate([[0], np.cumsum(counts)]), seq_lens=computed + counts,
        num_computed_tokens=computed, block_table=table, block_size=BS, slot_mapping=slots, rows=rows)
    q = torch.randn(batch * new, HQ, D)
    k, v = torch.randn(batch * new, HK, D), torch.randn(batch * new, HK, D)
    layer = SimpleNamespace(num_heads=HQ, num_kv_heads=HK, head_dim=D, scale=D**-0.5, sliding_window=None)
    result = {}
    space = VirtualKVSpace(1, num_blocks, BS, HK, D, torch.float32, batch, seq)
    space.pool.normal_()
    t = time.perf_counter()
    space.sync(rows, table, np.full(batch, per_req))
    result["map_ms_per_chunk"] = (time.perf_counter() - t) * 1e3 / (batch * per_req)
    layer.virtual_kv = (space.range_view(0, 0), space.range_view(0, 1))
    virtual = VirtualContiguousAttention()
    kv_virtual = space.pool[0]
    ref = TorchPagedAttention()
    out_virtual = virtual.forward(layer, q, k, v, kv_virtual, virtual.build_metadata(common))
    out_ref = ref.forward(layer, q, k, v, kv_virtual, ref.build_metadata(common))
    assert torch.allclose(out_virtual, out_ref, atol=1e-4), "virtual and paged attention disagree"
    result["virtual"] = _best_time(lambda: virtual.forward(layer, q, k, v, kv_virtual,
                                                             virtual.build_metadata(common)), iters)
    result["torch"] = _best_time(lambda: ref.forward(layer, q, k, v, kv_virtual, ref.build_metadata(common)),
                                   max(1, iters // 4))
    del layer.virtual_kv, kv_virtual, space
    try:
        cpu = CpuPagedAttention()
    except RuntimeError:
        return result
    kv_paged = torch.randn(2, num_blocks, BS, HK, D)
    result["cpu"] = _best_time(lambda: cpu.forward(layer, q, k, v, kv_paged, cpu.build_metadata(common)), iters)
    return result


def attention_tables(iters: int) -> None:
    """Fig. 7 (decode) and Fig. 8 (prefix prefill) on this CPU."""
    print("## Decode attention, one step, SmolLM2 shape (ms per layer; x30 for the model)")
    print("| batch | context | paged cpu kernel | paged torch (gather+SDPA) | virtual (SDPA on views) | "
          "virtual / cpu | map ms per chunk (once) |")
    print("|---|---|---|---|---|---|---|")
    for batch in (1, 32):
        for ctx in (512, 2048, 8192):
            r = _case(batch, ctx, 1, iters)
            cpu = r.get("cpu", float("nan"))
            print(f"| {batch} | {ctx} | {cpu * 1e3:.3f} | {r['torch'] * 1e3:.3f} | {r['virtual'] * 1e3:.3f} | "
                  f"{r['virtual'] / cpu:.2f}x | {r['map_ms_per_chunk']:.4f} |", flush=True)
    print("\n## Prefix prefill attention, prefix ratio 0.5 (ms per layer)")
    print("| batch | sequence | cached prefix | new tokens | paged cpu kernel | paged torch | virtual | "
          "virtual / cpu |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, seq in ((1, 2048), (4, 2048), (1, 8192)):
        r = _case(batch, seq // 2, seq // 2, max(2, iters // 4))
        cpu = r.get("cpu", float("nan"))
        print(f"| {batch} | {seq} | {seq // 2} | {seq // 2} | {cpu * 1e3:.1f} | {r['torch'] * 1e3:.1f} | "
              f"{r['virtual'] * 1e3:.1f} | {r['virtual'] / cpu:.2f}x |", flush=True)


def main() -> None:
    """Print the attention tables (markdown)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    attention_tables(args.iters)


if __name__ == "__main__":
    main()
