"""kv_cache_layout="virtual" (vTensor on the CPU): the mapped chunk pool, the engine's greedy output against the paged
layout and HF transformers on every scheduler path, no leaked mapping, and resident memory that follows the tokens."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch

from pagemill import LLM, SamplingParams
from pagemill.config import EngineArgs
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
    for layout in ("paged", "virtual"):
        llm = LLM(tiny_vt, kv_cache_layout=layout, **kwargs)
        outs = _generate(llm, prompts)
        outs_n = _generate(llm, prompts[-3:], n=2)
        stats = llm.get_stats()
        results[layout] = (outs, outs_n)
        assert stats.prefix_cache_hits > 0
        if num_blocks == 24:
            assert stats.num_preemptions > 0
    assert results["virtual"] == results["paged"]
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
