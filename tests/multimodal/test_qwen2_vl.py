"""Qwen2-VL and Qwen2.5-VL end to end against HF transformers (float32 greedy): prompts with 0, 1 and 3 images (grids of unequal
height and width, so M-RoPE's three sections differ), alone and batched with text-only prompts, chunked prefill
splitting the placeholder runs, preemption; the encoder runs once per image per request; the M-RoPE positions and
deltas equal transformers' get_rope_index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagemill import LLM, SamplingParams
from tests.multimodal.conftest import QWEN_IMAGE, build_tiny_qwen_vl, hf_llava_greedy, load_qwen_vl_hf, make_image

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

CASES = [
    ("USER: What is the capital of France? ASSISTANT:", 0),
    (f"USER: {QWEN_IMAGE}\nWhat is in this picture? ASSISTANT:", 1),
    (f"USER: Compare {QWEN_IMAGE} with {QWEN_IMAGE} and {QWEN_IMAGE}. Which is brighter? ASSISTANT:", 3),
    ("The quick brown fox", 0),
    (f"{QWEN_IMAGE} Describe it in one word:", 1),
]
SIZES = [(56, 36), (40, 40), (36, 60)]  # grids 6x10 / 10x10 / 12x8 patches (after resizing to 32..48 px)


@pytest.fixture(scope="module", params=["qwen2_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.slow)])
def tiny_qwen2_vl(request, tmp_path_factory) -> str:
    """The tiny model of each family (Qwen2.5-VL's run is marked slow: the file stays under two minutes)."""
    return build_tiny_qwen_vl(tmp_path_factory.mktemp(request.param), request.param == "qwen2_5_vl")


@pytest.fixture(scope="module")
def qwen2_vl_hf(tiny_qwen2_vl):
    return load_qwen_vl_hf(tiny_qwen2_vl)


def _images(case: tuple[str, int], seed: int) -> list:
    return [make_image(seed + k, SIZES[k % len(SIZES)]) for k in range(case[1])]


def _request(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


@pytest.fixture(scope="module")
def references(qwen2_vl_hf) -> list[tuple[str, list, list[int], list[int]]]:
    out = []
    for i, case in enumerate(CASES):
        images = _images(case, 10 * i)
        ids, ref = hf_llava_greedy(qwen2_vl_hf, case[0], images, MAX_TOKENS)
        out.append((case[0], images, ids, ref))
    return out


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.model_runner


def _check(llm: LLM, references, batch: list[int]) -> None:
    outs = llm.generate([_request(references[i][0], references[i][1]) for i in batch], GREEDY, use_tqdm=False)
    for i, o in zip(batch, outs):
        text, images, ids, ref = references[i]
        assert o.prompt_token_ids == ids, text
        assert o.outputs[0].token_ids == ref, (text, len(images))


def test_mrope_positions_equal_get_rope_index(tiny_qwen2_vl, qwen2_vl_hf, references):
    from pagemill.config import ModelConfig  # noqa: F401  (the engine's own processor splits the features)
    from pagemill.models.qwen2_vl import mrope_prompt_positions
    from pagemill.multimodal.processing import MultiModalProcessor

    model, processor = qwen2_vl_hf
    mm = MultiModalProcessor(type("MC", (), {"model": tiny_qwen2_vl, "mm_hf_config": model.config,
                                             "limit_mm_per_prompt": None, "allowed_local_media_path": None})())
    for text, images, ids, _ in references[1:3]:
        got_ids, features = mm.process(text, images)
        assert got_ids == ids and len({tuple(f.grid_thw) for f in features}) == len(features)
        inputs = processor(text=[text], images=images, return_tensors="pt")
        want, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 inputs["image_grid_thw"])
        pos, d = mrope_prompt_positions(len(ids), features, 2)
        assert np.array_equal(pos, want[:, 0].numpy()) and d == int(delta[0, 0])
        assert not np.array_equal(pos[1], pos[2])  # height and width ids differ: the sections matter


def test_vision_tower_equals_hf(tiny_qwen2_vl, qwen2_vl_hf, references):
    llm = LLM(tiny_qwen2_vl, kv_cache_memory="16MiB", max_model_len=256, dtype="float32")
    model, processor = qwen2_vl_hf
    image = references[1][1][0]
    inputs = processor(text=[references[1][0]], images=[image], return_tensors="pt")
    with torch.inference_mode():
        want = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        want = torch.cat(list(want.pooler_output if hasattr(want, "pooler_output") else want))
        ours = _runner(llm).model.embed_multimodal(inputs["pixel_values"][None], inputs["image_grid_thw"])[0]
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_alone_matches_hf(tiny_qwen2_vl, references, i):
    llm = LLM(tiny_qwen2_vl, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    _check(llm, references, [i])
    assert _runner(llm).encoder_cache.num_encoded == CASES[i][1]


def test_images_change_the_output(references):
    assert references[1][3] != references[4][3]


def test_batch_mixed_with_text_only(tiny_qwen2_vl, references):
    llm = LLM(tiny_qwen2_vl, kv_cache_memory="16MiB", max_model_len=256, block_size=8, enable_prefix_caching=False)
    batch = [i % len(CASES) for i in range(16)]
    _check(llm, references, batch)
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)
    llm.generate("Hello", GREEDY, use_tqdm=False)
    assert not _runner(llm).mrope.prompts  # freed with their requests


def test_chunked_prefill_splits_placeholders(tiny_qwen2_vl, references):
    llm = LLM(tiny_qwen2_vl, kv_cache_memory="16MiB", max_model_len=256, block_size=4, max_num_batched_tokens=7,
              enable_prefix_caching=False)
    batch = [0, 1, 2, 4, 2, 3]
    _check(llm, references, batch)
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)


def test_preemption_recomputes_without_reencoding(tiny_qwen2_vl, references):
    llm = LLM(tiny_qwen2_vl, max_model_len=160, block_size=4, num_gpu_blocks_override=50,
              max_num_batched_tokens=40, enable_prefix_caching=False)
    batch = [2, 1, 2, 4, 2, 1]
    _check(llm, references, batch)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)


def test_prefix_cache_same_image_hits(tiny_qwen2_vl, qwen2_vl_hf, references):
    llm = LLM(tiny_qwen2_vl, kv_cache_memory="16MiB", max_model_len=256, block_size=4)
    text, images, ids, ref = references[2]
    first = llm.generate(_request(text, images), GREEDY, use_tqdm=False)[0]
    again = llm.generate(_request(text, images), GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == ref
    assert again.num_cached_tokens >= len(ids) // 4 * 4 - 4
    other = [images[0], images[1], make_image(999, SIZES[2])]  # last image differs: its own HF output
    out = llm.generate(_request(text, other), GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_llava_greedy(qwen2_vl_hf, text, other, MAX_TOKENS)[1]


def test_chat_image_part_is_wrapped_in_vision_tokens(tiny_qwen2_vl, qwen2_vl_hf):
    from tests.multimodal.test_llava_server import data_url

    llm = LLM(tiny_qwen2_vl, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    image = make_image(5, SIZES[0])
    out = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                 {"type": "text", "text": "Describe it."}]}], GREEDY,
                   use_tqdm=False)[0]
    text = qwen2_vl_hf[1].tokenizer.apply_chat_template([{"role": "user", "content": f"{QWEN_IMAGE}\nDescribe it."}],
                                                        tokenize=False, add_generation_prompt=True)
    ids, ref = hf_llava_greedy(qwen2_vl_hf, text, [image], MAX_TOKENS, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref
