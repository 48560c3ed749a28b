"""LLaVA end to end against HF transformers (float32 greedy): prompts with 0, 1 and 3 images, alone and batched
with text-only prompts, with chunked prefill splitting the placeholder runs, with preemption; the encoder runs once
per image per request; the prefix cache keys placeholder blocks by the image."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from tests.multimodal.conftest import TOKENS_PER_IMAGE, hf_llava_greedy, make_image

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (prompt, number of images)
CASES = [
    ("USER: What is the capital of France? ASSISTANT:", 0),
    ("USER: <image>\nWhat is in this picture? ASSISTANT:", 1),
    ("USER: Compare <image> with <image> and <image>. Which is brighter? ASSISTANT:", 3),
    ("The quick brown fox", 0),
    ("<image> Describe it in one word:", 1),
]


def _prompt(case: tuple[str, int], seed: int) -> tuple[str, list]:
    text, n = case
    return text, [make_image(seed + k, (40 + 8 * k, 36)) for k in range(n)]


def _request(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


@pytest.fixture(scope="module")
def references(llava_hf) -> list[tuple[str, list, list[int], list[int]]]:
    out = []
    for i, case in enumerate(CASES):
        text, images = _prompt(case, 10 * i)
        ids, ref = hf_llava_greedy(llava_hf, text, images, MAX_TOKENS)
        out.append((text, images, ids, ref))
    return out


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.model_runner


def _check(llm: LLM, references, batch: list[int]) -> None:
    outs = llm.generate([_request(references[i][0], references[i][1]) for i in batch], GREEDY, use_tqdm=False)
    for i, o in zip(batch, outs):
        text, images, ids, ref = references[i]
        assert o.prompt_token_ids == ids, text
        assert o.outputs[0].token_ids == ref, (text, len(images))


def test_images_change_the_output(references):
    # the oracle is not vacuous: another image gives another continuation
    assert references[1][3] != references[4][3] or references[1][2] != references[4][2]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_alone_matches_hf(tiny_llava, references, i):
    llm = LLM(tiny_llava, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    _check(llm, references, [i])
    assert _runner(llm).encoder_cache.num_encoded == CASES[i][1]


def test_batch_mixed_with_text_only(tiny_llava, references):
    llm = LLM(tiny_llava, kv_cache_memory="16MiB", max_model_len=256, block_size=8, enable_prefix_caching=False)
    batch = [i % len(CASES) for i in range(16)]
    _check(llm, references, batch)
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)
    llm.generate("Hello", GREEDY, use_tqdm=False)  # (the runner learns of finished requests in the next step)
    assert not _runner(llm).encoder_cache.outputs  # freed with their requests


def test_chunked_prefill_splits_placeholders(tiny_llava, references):
    # 5-token steps: every placeholder run (16 tokens) is split over several steps, and shared with other requests
    llm = LLM(tiny_llava, kv_cache_memory="16MiB", max_model_len=256, block_size=4, max_num_batched_tokens=5,
              enable_prefix_caching=False)
    batch = [0, 1, 2, 4, 2, 3]
    _check(llm, references, batch)
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)  # once per image per request


def test_encoder_budget_of_one_image_per_step(tiny_llava, references):
    llm = LLM(tiny_llava, kv_cache_memory="16MiB", max_model_len=256, block_size=8,
              max_num_encoder_input_tokens=TOKENS_PER_IMAGE, enable_prefix_caching=False)
    batch = [2, 1, 2, 0]
    _check(llm, references, batch)
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)


def test_preemption_recomputes_without_reencoding(tiny_llava, references):
    llm = LLM(tiny_llava, max_model_len=128, block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    batch = [2, 1, 2, 4, 2, 1]
    _check(llm, references, batch)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)


def test_prefix_cache_no_cross_talk_and_hits(tiny_llava, llava_hf):
    llm = LLM(tiny_llava, kv_cache_memory="16MiB", max_model_len=256, block_size=4)
    text = "USER: <image>\nWhat is in this picture? Answer in detail please. ASSISTANT:"
    a, b = make_image(101), make_image(202)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    for image in (a, b):  # same text, different image: each its own HF output (no blocks shared over the image)
        out = llm.generate(_request(text, [image]), GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_llava_greedy(llava_hf, text, [image], MAX_TOKENS)[1]
    ids = out.prompt_token_ids
    first = ids.index(llava_hf[1].tokenizer.convert_tokens_to_ids("<image>"))
    # b's blocks before the image were hits; none over the image
    assert out.num_cached_tokens == first // 4 * 4
    hits = kv.prefix_cache_hits
    again = llm.generate(_request(text, [b]), GREEDY, use_tqdm=False)[0]  # the same image again: a hit over it
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.num_cached_tokens >= first + TOKENS_PER_IMAGE
    assert kv.prefix_cache_hits - hits == again.num_cached_tokens


def test_chat_with_image_part_matches_hf(tiny_llava, llava_hf):
    from tests.multimodal.test_llava_server import data_url

    llm = LLM(tiny_llava, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    image = make_image(5)
    conversation = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                 {"type": "text", "text": "Describe it."}]}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    text = llava_hf[1].tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nDescribe it."}],
                                                     tokenize=False, add_generation_prompt=True)
    ids, ref = hf_llava_greedy(llava_hf, text, [image], MAX_TOKENS, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref
    pil = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": "Describe it."}]}], GREEDY, use_tqdm=False)
    assert pil[0].outputs[0].token_ids == ref


def test_prefix_hit_ending_inside_an_image(tiny_llava, llava_hf):
    # same image, other text after it: the hit ends inside the placeholder run, the rest of the image is computed
    # from its encoder output's tail
    llm = LLM(tiny_llava, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    image = make_image(303)
    first = "USER: look <image>"  # the placeholder run does not end on a block boundary
    for tail in (" Is it red? ASSISTANT:", " Is it blue or green? ASSISTANT:"):
        out = llm.generate(_request(first + tail, [image]), GREEDY, use_tqdm=False)[0]
        ids, ref = hf_llava_greedy(llava_hf, first + tail, [image], MAX_TOKENS)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == ref
    start = ids.index(llava_hf[1].tokenizer.convert_tokens_to_ids("<image>"))
    assert start < out.num_cached_tokens < start + TOKENS_PER_IMAGE
    assert _runner(llm).encoder_cache.num_encoded == 2


def test_parallel_sampling_with_an_image(tiny_llava, references):
    llm = LLM(tiny_llava, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    text, images, _, ref = references[2]
    out = llm.generate(_request(text, images), SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS,
                                                              ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [ref, ref]
