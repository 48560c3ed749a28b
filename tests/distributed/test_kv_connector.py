"""KV connectors offline: P/D disaggregation over shared storage (producer then consumer) and a KV offload tier;
greedy tokens and logprobs equal a single instance's, the consumer computes only what it did not load."""

from __future__ import annotations

import os

import pytest

from pagemill import LLM, SamplingParams

BLOCK = 16
# prompt lengths around block edges: shorter than a block, exact multiples, one past
PROMPTS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((7, 16, 17, 48, 61, 100))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def _llm(model: str, **kw) -> LLM:
    return LLM(model, kv_cache_memory="16MiB", max_model_len=256, block_size=BLOCK, **kw)


def _storage(path, role: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def _prompts(prompts=PROMPTS) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def assert_same_outputs(got, want) -> None:
    """Token for token, logprobs within 1e-4."""
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert abs(lg[t].logprob - lw[t].logprob) < 1e-4


def loadable_tokens(prompts=PROMPTS) -> int:
    """Full blocks before each prompt's last token, in tokens."""
    return sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)


def assert_no_leak(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The single-instance outputs."""
    return _llm(tiny_llama).generate(_prompts(), GREEDY, use_tqdm=False)


@pytest.mark.parametrize("chunked", [False, True])
def test_shared_storage_disaggregated_prefill(tiny_llama, reference, tmp_path, chunked):
    # chunked: the producer's prompts take several steps (each completed block is saved after its step)
    producer = _llm(tiny_llama, kv_transfer_config=_storage(tmp_path, "kv_producer"),
                    max_num_batched_tokens=24 if chunked else None)
    prefill = producer.generate(_prompts(), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert [o.outputs[0].token_ids[0] for o in prefill] == [o.outputs[0].token_ids[0] for o in reference]
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) == sum(len(p) // BLOCK for p in PROMPTS)  # every full prompt block, once
    assert producer.get_stats().external_prefix_cache_hits == 0  # a producer loads nothing
    assert_no_leak(producer)
    del producer

    consumer = _llm(tiny_llama, kv_transfer_config=_storage(tmp_path, "kv_consumer"))
    out = consumer.generate(_prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(out, reference)
    stats = consumer.get_stats()
    loaded = loadable_tokens()
    assert stats.external_prefix_cache_hits == loaded > 0
    assert [o.num_cached_tokens for o in out] == [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    # the prompt tokens it computed: only those after the loaded blocks
    assert stats.num_prompt_tokens == sum(len(p) for p in PROMPTS) - loaded
    assert stats.prefix_cache_hits == 0
    assert_no_leak(consumer)
    assert len([f for _, _, fs in os.walk(tmp_path) for f in fs]) == len(files)  # a consumer saves nothing


def test_consumer_computes_what_storage_lacks(tiny_llama, reference, tmp_path):
    # the producer saw only the first half of the prompts: the consumer loads what is there, computes the rest
    producer = _llm(tiny_llama, kv_transfer_config=_storage(tmp_path, "kv_producer"))
    producer.generate(_prompts(PROMPTS[::2]), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    del producer
    consumer = _llm(tiny_llama, kv_transfer_config=_storage(tmp_path, "kv_consumer"))
    out = consumer.generate(_prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(out, reference)
    assert consumer.get_stats().external_prefix_cache_hits == loadable_tokens(PROMPTS[::2])
    assert_no_leak(consumer)


def test_kv_both_is_an_offload_tier(tiny_llama, reference, tmp_path):
    # kv_both saves what it computes and reads it back on a prefix hit that its own cache has lost
    llm = _llm(tiny_llama, kv_transfer_config=_storage(tmp_path, "kv_both"))
    first = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(first, reference)
    assert llm.get_stats().external_prefix_cache_hits == 0
    assert llm.reset_prefix_cache()  # the KV blocks in memory are gone ...
    again = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(again, reference)
    stats = llm.get_stats()
    assert stats.external_prefix_cache_hits == loadable_tokens()  # ... and come back from the tier
    assert_no_leak(llm)


def test_bad_kv_transfer_config(tiny_llama):
    with pytest.raises(ValueError, match="kv_transfer_config.kv_role"):
        _llm(tiny_llama, kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "decoder"})
    with pytest.raises(ValueError, match="kv_transfer_config.kv_connector"):
        _llm(tiny_llama, kv_transfer_config={"kv_connector": "Nixl", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="unknown keys"):
        _llm(tiny_llama, kv_transfer_config='{"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_rnak": 1}')
    with pytest.raises(ValueError, match="kv_role: ZmqConnector"):
        _llm(tiny_llama, kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="extra_config.producers"):
        _llm(tiny_llama, kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_consumer",
                                             "kv_connector_extra_config": {"producers": "127.0.0.1:9"}})
    ok = _storage("/tmp/unused", "kv_both")
    with pytest.raises(ValueError, match="kv_transfer_config: KV connectors run with one rank"):
        _llm(tiny_llama, kv_transfer_config=ok, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_transfer_config: KV connectors move paged KV blocks"):
        _llm(tiny_llama, kv_transfer_config=ok, kv_cache_layout="virtual")


def test_kv_transfer_config_flag():
    from pagemill.entrypoints.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-transfer-config",
                              '{"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_port": 9000}'])
    assert args.kv_transfer_config == {"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_port": 9000}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-transfer-config", '{"kv_connector": "ZmqConnector", "kv_port": 9000}'])


def test_proxy_prefill_request():
    from pagemill.distributed.kv_transfer.disagg_proxy import prefill_body

    body = {"model": "m", "messages": [], "max_completion_tokens": 50, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}}
    assert prefill_body(body) == {"model": "m", "messages": [], "max_completion_tokens": 1, "max_tokens": 1, "n": 1}


def test_consumer_preempted_loads_again(tiny_llama, reference, tmp_path):
    # a pool too small for the batch: requests are preempted by recompute and load their prompts' KV again
    producer = _llm(tiny_llama, kv_transfer_config=_storage(tmp_path, "kv_producer"))
    producer.generate(_prompts(), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    del producer
    consumer = LLM(tiny_llama, max_model_len=128, block_size=BLOCK, num_gpu_blocks_override=12,
                   enable_prefix_caching=False, kv_transfer_config=_storage(tmp_path, "kv_consumer"))
    out = consumer.generate(_prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(out, reference)
    stats = consumer.get_stats()
    assert stats.num_preemptions > 0
    assert stats.external_prefix_cache_hits > loadable_tokens()  # the preempted ones loaded twice
    assert_no_leak(consumer)
