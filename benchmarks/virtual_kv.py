"""kv_cache_layout paged vs virtual (vTensor), side by side in one run: the paper's kernel figures on the CPU.

    python benchmarks/virtual_kv.py                 # decode + prefix-prefill attention, SmolLM2's shape
    python benchmarks/virtual_kv.py --engine        # + engine runs: page faults per step, tok/s, memory waste
    python benchmarks/virtual_kv.py --engine --no-attention
    python benchmarks/virtual_kv.py --engine --no-attention --no-memory --num-prompts 4 --output-len 40  # smoke run

The engine table runs the virtual layout twice: chunks allocated one step ahead mapped by the background thread
while the forward runs (the default), and mapped on the step path before the forward (A/B); the counters say how
many mmap calls and ms each path took per step and how many chunks a step entered already mapped.

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
import resource
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
# The virtual layout with its chunks allocated ahead mapped before the forward instead of in the background (A/B).
_ON_STEP = "virtual, ahead chunks mapped on the step path"


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


def engine_table(num_prompts: int, prompt_len: int, output_len: int, rounds: int) -> None:
    """The layouts on the same batch (SmolLM2), in alternating rounds (best wall time of each): output tok/s, minor
    page faults per step, KV memory resident vs tokens stored."""
    from pagemill import LLM, SamplingParams

    print(f"\n## Engine: {num_prompts} prompts x {prompt_len} tokens, {output_len} new (SmolLM2, greedy), best of "
          f"{rounds} alternating rounds")
    print("| layout (attention) | wall s | output tok/s | steps | minor faults / step |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, prompt_len).tolist()} for _ in range(num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    setups = {"paged (cpu kernel)": dict(kv_cache_layout="paged"),
              "paged (torch: gather + SDPA)": dict(kv_cache_layout="paged", attention_backend="torch"),
              "virtual (SDPA on views)": dict(kv_cache_layout="virtual"),
              _ON_STEP: dict(kv_cache_layout="virtual")}
    llms = {name: LLM(kv_cache_memory="1GiB", max_model_len=2048, enable_prefix_caching=False, **kw)
            for name, kw in setups.items()}
    llms[_ON_STEP].llm_engine.engine_core.executor.model_runner.kv_space.map_ahead_in_background = False
    best: dict[str, tuple[float, int, int]] = {}
    outputs = {}
    total_steps = dict.fromkeys(llms, 0)
    for _ in range(rounds):
        for name, llm in llms.items():
            core = llm.llm_engine.engine_core
            steps = 0
            step = core.step

            def counted():
                nonlocal steps
                steps += 1
                return step()

            core.step = counted
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            del core.step
            outputs[name] = [o.outputs[0].token_ids for o in outs]
            total_steps[name] += steps
            if name not in best or wall < best[name][0]:
                best[name] = (wall, steps, faults)
    for name in llms:
        wall, steps, faults = best[name]
        print(f"| {name} | {wall:.1f} | {num_prompts * output_len / wall:.1f} | {steps} | {faults / steps:.0f} |",
              flush=True)
    same = all(out == outputs["paged (cpu kernel)"] for out in outputs.values())
    print(f"\nSame greedy tokens in every layout: {same}")
    print("\n| virtual layout, chunks mapped ahead | mmap calls / step: step path, background | "
          "mapping ms / step: step path, background | chunks a step entered: found mapped, mapped on the step |")
    print("|---|---|---|---|")
    for name in ("virtual (SDPA on views)", _ON_STEP):
        space = llms[name].llm_engine.engine_core.executor.model_runner.kv_space
        space.wait()
        n = total_steps[name]
        print(f"| {'in the background' if name != _ON_STEP else 'on the step path'} | "
              f"{space.num_step_map_calls / n:.1f}, {space.num_background_map_calls / n:.1f} | "
              f"{space.step_map_seconds * 1e3 / n:.3f}, {space.background_map_seconds * 1e3 / n:.3f} | "
              f"{space.num_chunks_found_mapped}, {space.num_chunks_mapped_on_step} |", flush=True)


def memory_table(num_prompts: int, prompt_len: int) -> None:
    """KV bytes resident (pages the OS backs, mincore) once a fresh engine has prefilled `num_prompts` prompts,
    against tokens x bytes per token: the waste is each request's partly filled last chunk / block."""
    from pagemill import SamplingParams
    from pagemill.engine.arg_utils import EngineArgs
    from pagemill.engine.core import EngineCore
    from pagemill.messages import EngineCoreRequest

    print(f"\n## KV memory: {num_prompts} requests of {prompt_len + 1}..{prompt_len + num_prompts} tokens stored, "
          "fresh engine (SmolLM2)")
    print("| layout | KV resident MiB | tokens x bytes/token MiB | waste MiB | waste / request | reserved virtual GiB |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    lens = [prompt_len + 1 + i for i in range(num_prompts)]
    prompts = [rng.integers(100, 40000, n).tolist() for n in lens]
    for layout in ("paged", "virtual"):
        core = EngineCore(EngineArgs(kv_cache_layout=layout, kv_cache_memory="1GiB", max_model_len=2048,
                                     max_num_seqs=num_prompts).create_engine_config())
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(str(i), p, SamplingParams(temperature=0, max_tokens=8), None,
                                               time.monotonic()))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
            core.step()
        runner = core.executor.model_runner
        cache = runner.kv_cache
        token_bytes = cache[:, :, 0, 0].numel() * cache.element_size()
        stored = sum(r.num_computed_tokens for r in core.scheduler.requests.values()) * token_bytes
        resident = _resident_bytes(cache.data_ptr(), cache.numel() * cache.element_size())
        space = getattr(runner, "kv_space", None)
        reserved = space.reserve_bytes / 2**30 if space is not None else 0.0
        print(f"| {layout} | {resident / 2**20:.2f} | {stored / 2**20:.2f} | {(resident - stored) / 2**20:.2f} | "
              f"{(resident - stored) / num_prompts / 1024:.0f} KiB | {reserved:.1f} |", flush=True)
        del core, runner, cache


def _resident_bytes(addr: int, length: int) -> int:
    """Bytes of [addr, addr + length) backed by memory now (mincore; addr is page-aligned)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def main() -> None:
    """Print the tables (markdown)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--engine", action="store_true", help="also run both layouts in the engine")
    ap.add_argument("--no-attention", action="store_true", help="skip the attention tables")
    ap.add_argument("--memory-only", action="store_true", help="only the KV memory table")
    ap.add_argument("--no-memory", action="store_true", help="with --engine: skip the KV memory table")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_only:
        memory_table(16, 256)
        return
    if not args.no_attention:
        attention_tables(args.iters)
    if args.engine:
        if not args.no_memory:
            memory_table(16, 256)
        engine_table(args.num_prompts, args.prompt_len, args.output_len, args.rounds)


if __name__ == "__main__":
    main()
