"""SmolVLM / Idefics3 end to end against HF transformers (float32 greedy): the processor splits each image into up to
2x2 tiles plus a global one (each tile its own placeholder run and encoder output); prompts with 0, 1 and 3 images,
alone and batched with text-only prompts, chunked prefill splitting placeholder runs, preemption, the prefix cache;
the encoder runs once per tile per request."""

from __future__ import annotations

import numpy as np
import pytest

from pagemill import LLM, SamplingParams
from tests.multimodal.conftest import hf_llava_greedy, make_image

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (prompt, image sizes): wide, tall and small images give different tile grids
CASES = [
    ("What is the capital of France?", []),
    ("Look <image> what is it?", [(48, 40)]),
    ("A <image> B <image> C <image> D: which is brighter?", [(80, 30), (20, 20), (30, 60)]),
    ("The quick brown fox", []),
    ("<image> Describe it in one word:", [(64, 64)]),
]


def _request(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def _num_tiles(ids: list[int], token_id: int) -> int:
    """Placeholder runs in a prompt (one per tile)."""
    is_ph = np.concatenate([[False], np.asarray(ids) == token_id])
    return int(np.count_nonzero(is_ph[1:] & ~is_ph[:-1]))


@pytest.fixture(scope="module")
def references(idefics3_hf) -> list[tuple[str, list, list[int], list[int], int]]:
    out = []
    for i, (text, sizes) in enumerate(CASES):
        images = [make_image(10 * i + k, size) for k, size in enumerate(sizes)]
        ids, ref = hf_llava_greedy(idefics3_hf, text, images, MAX_TOKENS)
        out.append((text, images, ids, ref, _num_tiles(ids, idefics3_hf[0].config.image_token_id)))
    return out


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.model_runner


def _check(llm: LLM, references, batch: list[int]) -> None:
    outs = llm.generate([_request(references[i][0], references[i][1]) for i in batch], GREEDY, use_tqdm=False)
    for i, o in zip(batch, outs):
        text, images, ids, ref, _ = references[i]
        assert o.prompt_token_ids == ids, text
        assert o.outputs[0].token_ids == ref, (text, len(images))


def test_images_change_the_output_and_are_split(references):
    assert references[1][3] != references[4][3]
    assert references[1][4] == 5 and references[2][4] > 3  # 2x2 tiles + the global one


@pytest.mark.parametrize("i", range(len(CASES)))
def test_alone_matches_hf(tiny_idefics3, references, i):
    llm = LLM(tiny_idefics3, kv_cache_memory="16MiB", max_model_len=512, block_size=8)
    _check(llm, references, [i])
    assert _runner(llm).encoder_cache.num_encoded == references[i][4]


def test_batch_mixed_with_text_only(tiny_idefics3, references):
    llm = LLM(tiny_idefics3, kv_cache_memory="32MiB", max_model_len=512, block_size=8, enable_prefix_caching=False)
    batch = [i % len(CASES) for i in range(16)]
    _check(llm, references, batch)
    assert _runner(llm).encoder_cache.num_encoded == sum(references[i][4] for i in batch)


def test_chunked_prefill_splits_placeholders(tiny_idefics3, references):
    # 7-token steps: every 16-token tile run is split over several steps (a causal decoder: no whole-run rule)
    llm = LLM(tiny_idefics3, kv_cache_memory="16MiB", max_model_len=512, block_size=4, max_num_batched_tokens=7,
              enable_prefix_caching=False)
    batch = [1, 2, 0, 4]
    _check(llm, references, batch)
    assert _runner(llm).encoder_cache.num_encoded == sum(references[i][4] for i in batch)


def test_preemption_recomputes_without_reencoding(tiny_idefics3, references):
    llm = LLM(tiny_idefics3, max_model_len=384, block_size=4, num_gpu_blocks_override=110, max_num_batched_tokens=48,
              enable_prefix_caching=False)
    batch = [2, 1, 4, 1, 2]
    _check(llm, references, batch)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert _runner(llm).encoder_cache.num_encoded == sum(references[i][4] for i in batch)


def test_prefix_cache_no_cross_talk_and_hits(tiny_idefics3, idefics3_hf):
    llm = LLM(tiny_idefics3, kv_cache_memory="16MiB", max_model_len=512, block_size=4)
    text = "Here: <image> What is in this picture? Answer in detail please."
    a, b = make_image(101), make_image(202)
    for image in (a, b):  # same text, different image: each its own HF output
        out = llm.generate(_request(text, [image]), GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_llava_greedy(idefics3_hf, text, [image], MAX_TOKENS)[1]
    first = out.prompt_token_ids.index(idefics3_hf[0].config.image_token_id)
    assert out.num_cached_tokens <= first  # no block over b's tiles came from a's
    again = llm.generate(_request(text, [b]), GREEDY, use_tqdm=False)[0]  # the same image again: hits over it
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    last = len(out.prompt_token_ids) - 1 - out.prompt_token_ids[::-1].index(idefics3_hf[0].config.image_token_id)
    assert again.num_cached_tokens >= last // 4 * 4
    assert _runner(llm).encoder_cache.num_encoded == 10  # 5 tiles each for a and b; none for the full hit


def test_chat_with_image_part_matches_hf(tiny_idefics3, idefics3_hf):
    from tests.multimodal.test_llava_server import data_url

    llm = LLM(tiny_idefics3, kv_cache_memory="16MiB", max_model_len=512, block_size=8)
    image = make_image(5)
    conversation = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                 {"type": "text", "text": "Describe it."}]}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    text = idefics3_hf[1].tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nDescribe it."}],
                                                        tokenize=False, add_generation_prompt=True)
    ids, ref = hf_llava_greedy(idefics3_hf, text, [image], MAX_TOKENS, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref
