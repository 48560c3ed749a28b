"""kv_cache_layout="virtual" (vTensor on the CPU): the mapped chunk pool, the engine's greedy output against the paged
layout and HF transformers on every scheduler path, no leaked mapping, and resident memory that follows the tokens."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch

from pagemill import LLM, SamplingParams
from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.core import EngineCore
from pagemill.messages import EngineCoreRequest
from pagemill.worker.virtual_kv import VirtualKVSpace, memfd_mappings
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the virtual layout needs Linux")

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32  # one layer's K for 16 tokens: 16 x 2 x 32 x 4 bytes = one 4 KiB page


@pytest.fixture(scope="module")
def tiny_vt(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers) whose 16-token KV chunks are whole pages, with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagemill.benchmarks.model_path import load_hf_tokenizer
    from pagemill.loader.default_model import default_model_path

    tokenizer = load_hf_tokenizer(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HEADS * HEAD_DIM, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = tmp_path_factory.mktemp("tiny_vt")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.model_runner


def _drain(llm: LLM) -> None:
    """The engine's next step: the runner learns of the requests that finished last."""
    core = llm.llm_engine.engine_core
    core.executor.execute_model(core.scheduler.schedule())


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 4000, 40).tolist()  # 2.5 blocks: prefix-cache hits of 2 full blocks
    prompts = [rng.integers(3, 4000, int(n)).tolist() for n in rng.integers(4, 90, 24)]
    prompts += [shared + rng.integers(3, 4000, int(n)).tolist() for n in rng.integers(1, 30, 8)]
    return prompts


def _generate(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=n)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("num_blocks", [400, 24])  # 24: a pool too small for the batch, so requests are preempted
def test_greedy_matches_paged_and_hf(tiny_vt, num_blocks):
    """A batch of 32 (chunked prefill with a 32-token budget, prefix hits, n = 2 siblings sharing the prompt) gives
    the paged layout's tokens and HF's; afterwards no chunk is mapped and every block is free."""
    from transformers import AutoModelForCausalLM

    prompts = _prompts()
    kwargs = dict(block_size=BLOCK, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=32,
                  num_gpu_blocks_override=num_blocks)
    results = {}
    # virtual-async: async scheduling plans a step while the previous one runs (and maps its chunks ahead).
    for name, layout, extra in (("paged", "paged", {}), ("virtual-async", "virtual", {"async_scheduling": True}),
                                ("virtual", "virtual", {})):
        llm = LLM(tiny_vt, kv_cache_layout=layout, **kwargs, **extra)
        outs = _generate(llm, prompts)
        outs_n = _generate(llm, prompts[-3:], n=2)
        stats = llm.get_stats()
        results[name] = (outs, outs_n)
        assert stats.prefix_cache_hits > 0
        if num_blocks == 24:
            assert stats.num_preemptions > 0
        if layout == "virtual":  # decodes crossed into chunks mapped ahead
            assert _runner(llm).kv_space.num_chunks_found_mapped > 0
    assert results["virtual"] == results["paged"] == results["virtual-async"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_vt, dtype=torch.float32).eval()
    for p, out in zip(prompts[::4], results["virtual"][0][::4]):
        assert out[0] == hf_greedy(hf, p, 12)
    for p, out in zip(prompts[-3:], results["virtual"][1]):
        assert out == [hf_greedy(hf, p, 12)] * 2

    space = _runner(llm).kv_space
    # Lazily unmapped: the last requests' chunks stay mapped until the runner hears they finished (next step).
    assert space.num_mapped_chunks() > 0 and space.mapped_regions() > 0
    _drain(llm)
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total and stats.num_running_reqs == 0
    assert space.num_mapped_chunks() == 0
    assert space.mapped_regions() == 0  # /proc/self/maps: no chunk mapping left in the reserved ranges


def test_resident_memory_follows_tokens_and_shared_prefix_is_resident_once(tiny_vt):
    """Resident pool bytes = tokens x bytes per token, within one chunk per request; a 500-token prefix that two
    running requests share is resident once, mapped into both requests' ranges."""
    core = EngineCore(EngineArgs(tiny_vt, kv_cache_layout="virtual", block_size=BLOCK, max_model_len=1024,
                                 num_gpu_blocks_override=256).create_engine_config())
    runner = core.executor.model_runner
    space = runner.kv_space
    token_bytes = 2 * 2 * KV_HEADS * HEAD_DIM * 4  # 2 layers x K and V
    chunk_bytes = BLOCK * token_bytes
    assert space.resident_bytes() == 0
    prefix = np.random.default_rng(1).integers(3, 4000, 500).tolist()
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", prefix + [7, 8, 9], sp, None, time.monotonic()))
    core.step()  # a's 503 prompt tokens
    one = space.resident_bytes()
    assert 503 * token_bytes <= one < 503 * token_bytes + chunk_bytes
    core.add_request(EngineCoreRequest("b", prefix + [10, 11, 12, 13], sp, None, time.monotonic()))
    core.step()  # a decodes into its last chunk; b hits 31 full chunks (496 tokens) and writes 8 into a new one
    two = space.resident_bytes()
    assert 0 < two - one <= chunk_bytes
    row_a, row_b = (runner.input_batch.req_id_to_row[r] for r in ("a", "b"))
    shared = space.mapped[row_a, :31]
    assert (shared >= 0).all() and (space.mapped[row_b, :31] == shared).all()
    # Both ranges read the same physical K: the shared prefix through either request's contiguous view.
    k = runner.model.attention_layers()[0].virtual_kv[0]
    assert torch.equal(k[row_a, :496], k[row_b, :496]) and k[row_a, :496].abs().sum() > 0
    assert not torch.equal(k[row_a, 496:504], k[row_b, 496:504])


def test_space_maps_reads_and_trims():
    """Chunks written through the paged pool view read back through a slot's contiguous range; remapping and
    trimming leave only the pool view mapped."""
    space = VirtualKVSpace(num_layers=2, num_blocks=8, block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           dtype=torch.float32, num_slots=3, max_model_len=64)
    before = memfd_mappings()
    assert space.mapped_regions() == 0
    space.pool.copy_(torch.randn_like(space.pool))
    table = np.zeros((3, 4), dtype=np.int64)
    table[0, :3] = [5, 6, 2]
    table[2, :2] = [5, 1]
    num_blocks = np.array([3, 0, 2])
    space.sync(np.array([0, 2]), table, num_blocks)
    assert space.num_map_calls == 4 * 2 * 2  # runs (5, 6), (2) of slot 0 and (5), (1) of slot 2, per layer and K/V
    for layer in range(2):
        for kv in range(2):
            view = space.range_view(layer, kv)
            pool = space.pool[layer, kv]
            assert torch.equal(view[0, :48], torch.cat([pool[5], pool[6], pool[2]]))
            assert torch.equal(view[2, :32], torch.cat([pool[5], pool[1]]))
            assert view[1].abs().sum() == 0  # never mapped: reads zeros
    assert memfd_mappings() > before and space.mapped_regions() == 4 * 2 * 2  # one per mmap call
    table[0, 1] = 7  # a replaced block: only that chunk is remapped
    calls = space.num_map_calls
    space.sync(np.array([0]), table, num_blocks)
    assert space.num_map_calls - calls == 2 * 2
    assert torch.equal(space.range_view(1, 1)[0, 16:32], space.pool[1, 1, 7])
    space.release(0)
    space.release(2)
    space.trim()
    assert space.num_mapped_chunks() == 0 and space.mapped_regions() == 0 and memfd_mappings() == before
    assert space.range_view(0, 0)[0, :48].abs().sum() == 0


def test_decode_finds_the_next_chunk_mapped_ahead(tiny_vt):
    """In steady-state decode every step that crosses into a new chunk finds it mapped (by the background thread,
    during the step before) and the step path maps nothing; the block mapped ahead is one the scheduler allocated
    (a request holds the block of its next token); a finished request's chunk mapped ahead is unmapped with the rest."""
    core = EngineCore(EngineArgs(tiny_vt, kv_cache_layout="virtual", block_size=BLOCK, max_model_len=256,
                                 num_gpu_blocks_override=64).create_engine_config())
    runner, sched = core.executor.model_runner, core.scheduler
    space, ib = runner.kv_space, runner.input_batch
    rng = np.random.default_rng(2)
    # a ends holding a block allocated ahead (48 tokens computed); b's prompt fills 2 chunks, so its third is
    # mapped ahead during its prefill; c crosses two chunk boundaries while decoding.
    lengths = {"a": (30, 19), "b": (32, 40), "c": (47, 33)}
    for rid, (prompt_len, max_tokens) in lengths.items():
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineCoreRequest(rid, rng.integers(3, 4000, prompt_len).tolist(), sp, None,
                                           time.monotonic()))
    core.step()  # every prompt in one step
    assert all(r.num_computed_tokens == r.num_prompt_tokens for r in sched.running)
    row_a = ib.req_id_to_row["a"]
    before = (space.num_step_map_calls, space.num_chunks_mapped_on_step, space.num_chunks_found_mapped,
              space.num_background_map_calls)
    crossings = 0
    while sched.has_unfinished_requests():
        crossings += sum(r.num_computed_tokens % BLOCK == 0 for r in sched.running)  # this decode enters a chunk
        core.step()
        space.wait()
        for r in sched.running:
            blocks = sched.kv_cache_manager.get_block_ids(r.request_id)[0]
            assert len(blocks) == -(-(r.num_computed_tokens + 1) // BLOCK)  # the next token's block is allocated
            row = ib.req_id_to_row[r.request_id]
            assert space.mapped[row, :len(blocks)].tolist() == blocks  # ... and mapped
    assert crossings == 6  # a at 32; b at 32, 48, 64; c at 48, 64
    assert space.num_chunks_found_mapped - before[2] == crossings
    assert (space.num_step_map_calls, space.num_chunks_mapped_on_step) == before[:2]  # the step path mapped nothing
    assert space.num_background_map_calls - before[3] == 2 * 2 * 6  # a's ahead 48 too, b's 32 was mapped at prefill
    assert (space.mapped[row_a, :4] >= 0).all()  # a finished with 48 tokens: its fourth chunk was mapped ahead
    core.executor.execute_model(sched.schedule())  # the runner hears that c finished: idle, all unmapped
    assert space.num_mapped_chunks() == 0 and space.mapped_regions() == 0
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_prepare_step_maps_ahead_in_the_background():
    """prepare_step maps what the step reads at once and the chunks allocated ahead in the background; the next step
    that enters such a chunk counts it found mapped; with map_ahead_in_background off they are mapped at once."""
    space = VirtualKVSpace(num_layers=2, num_blocks=8, block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           dtype=torch.float32, num_slots=2, max_model_len=64)
    space.pool.copy_(torch.randn_like(space.pool))
    table = np.zeros((2, 4), dtype=np.int64)
    table[0, :3] = [3, 4, 6]
    table[1, :2] = [5, 1]
    slots = np.array([0, 1])
    # slot 0: 20 tokens cached, 12 new (chunks 0-1 read), block 6 allocated ahead; slot 1: 17 new tokens.
    space.prepare_step(slots, table, first_new=np.array([2, 0]), need=np.array([2, 2]), have=np.array([3, 2]))
    assert space.num_step_map_calls == 3 * 2 * 2  # runs (3, 4) of slot 0 and (5), (1) of slot 1, per layer and K/V
    assert space.num_chunks_mapped_on_step == 2 and space.num_chunks_found_mapped == 0
    space.wait()
    assert space.num_background_map_calls == 2 * 2  # block 6 at chunk 2 of slot 0
    for layer in range(2):
        for kv in range(2):
            assert torch.equal(space.range_view(layer, kv)[0, :48], space.pool[layer, kv, [3, 4, 6]].flatten(0, 1))
    # slot 0 decodes token 32: it enters chunk 2, already mapped
    space.prepare_step(slots[:1], table, first_new=np.array([2]), need=np.array([3]), have=np.array([3]))
    assert space.num_chunks_found_mapped == 1 and space.num_step_map_calls == 3 * 2 * 2
    space.map_ahead_in_background = False
    table[1, 2] = 7
    space.prepare_step(slots[1:], table, first_new=np.array([2]), need=np.array([2]), have=np.array([3]))
    assert space.num_step_map_calls == 4 * 2 * 2 and space.num_background_map_calls == 2 * 2
    assert space.mapped[1, :3].tolist() == [5, 1, 7]
    space.release(0)
    space.release(1)
    space.trim()
    assert space.num_mapped_chunks() == 0 and space.mapped_regions() == 0


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_allocates_one_block_ahead_from_the_pool(seed):
    """kv_cache_layout="virtual": the scheduler holds the block of each running request's next token (one more than
    paged at a block boundary), inside the same pool and accounting; everything is freed at the end."""
    import random

    from pagemill.config import CacheConfig, SchedulerConfig
    from pagemill.core.kv_cache_utils import KVCacheConfig
    from pagemill.core.scheduler import Scheduler
    from tests.core.test_scheduler_invariants import run_random_workload

    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([12, 20, 40]), rng.choice([2, 4, 8])
    s = Scheduler(SchedulerConfig(max_num_seqs=rng.choice([2, 4, 16]), max_num_batched_tokens=rng.choice([8, 16, 64]),
                                  max_model_len=(num_blocks - 1) * block_size),
                  CacheConfig(block_size=block_size, kv_cache_layout="virtual"), KVCacheConfig(num_blocks, block_size))
    assert s.num_lookahead_tokens == 1
    schedule = s.schedule

    def checked_schedule():
        so = schedule()
        for rid, n in so.num_scheduled_tokens.items():
            req = s.requests[rid]  # num_computed_tokens already counts this step's tokens
            table = s.kv_cache_manager.get_block_ids(rid)[0]
            assert len(table) == -(-(req.num_computed_tokens + 1) // block_size)
        return so

    s.schedule = checked_schedule
    run_random_workload(s, rng, steps=60, shared_len=12, max_suffix=20, max_tokens=16)  # invariants every step
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert not any(g.req_to_blocks for g in s.kv_cache_manager.groups)


def test_bad_options_name_the_layout(tiny_vt, monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_layout must be one of paged, virtual"):
        EngineArgs(tiny_vt, kv_cache_layout="contiguous").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_layout='virtual'.*attention_backend='cpu'"):
        EngineArgs(tiny_vt, kv_cache_layout="virtual", attention_backend="cpu").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_layout='virtual'.*block_size that is a multiple of 16"):
        LLM(tiny_vt, kv_cache_layout="virtual", block_size=8, max_model_len=64, num_gpu_blocks_override=8)
    # A reservation larger than the address space: the OS refuses it, and the error says which layout to use.
    with pytest.raises(ValueError, match="kv_cache_layout='virtual': the OS refused the KV mappings.*'paged'"):
        VirtualKVSpace(1, 4, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, num_slots=2**24, max_model_len=2**24)
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ValueError, match="kv_cache_layout='virtual' needs Linux"):
        VirtualKVSpace(1, 4, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, num_slots=1, max_model_len=64)


def test_cli_flag_reaches_the_cache_config(tiny_vt):
    """`--kv-cache-layout virtual` (generated from EngineArgs) sets the cache config; paged stays the default."""
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).kv_cache_layout == "paged"
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", tiny_vt, "--kv-cache-layout", "virtual"]))
    assert args.create_engine_config().cache_config.kv_cache_layout == "virtual"
