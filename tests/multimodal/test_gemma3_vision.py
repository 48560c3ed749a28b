"""Gemma 3 with images end to end against HF transformers (float32 greedy): prompts with 0, 1 and 3 images, alone
and batched with text-only prompts, chunked prefill (a budget smaller than the prompt: an image's placeholder run is
never split), preemption, the prefix cache; image tokens attend bidirectionally within their image (HF's
token_type_ids mask) on the cpu and torch attention backends; the encoder runs once per image per request."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from tests.multimodal.conftest import GEMMA3_IMAGE, GEMMA3_TOKENS_PER_IMAGE, hf_llava_greedy, make_image

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMG = GEMMA3_IMAGE

# (prompt, number of images)
CASES = [
    ("What is the capital of France?", 0),
    (f"Look {IMG} what is it?", 1),
    (f"A {IMG} B {IMG} C {IMG} D: which is brighter?", 3),
    ("The quick brown fox", 0),
    (f"{IMG} Describe it in one word:", 1),
]


def _request(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


@pytest.fixture(scope="module")
def references(gemma3_hf) -> list[tuple[str, list, list[int], list[int]]]:
    out = []
    for i, (text, n) in enumerate(CASES):
        images = [make_image(10 * i + k, (40 + 8 * k, 36)) for k in range(n)]
        ids, ref = hf_llava_greedy(gemma3_hf, text, images, MAX_TOKENS)
        out.append((text, images, ids, ref))
    return out


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.model_runner


def _outputs(llm: LLM, references, batch: list[int]) -> list[list[int]]:
    outs = llm.generate([_request(references[i][0], references[i][1]) for i in batch], GREEDY, use_tqdm=False)
    for i, o in zip(batch, outs):
        assert o.prompt_token_ids == references[i][2], references[i][0]
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(llm: LLM, references, batch: list[int]) -> None:
    for i, got in zip(batch, _outputs(llm, references, batch)):
        assert got == references[i][3], (references[i][0], len(references[i][1]))


def test_images_change_the_output(references):
    assert references[1][3] != references[4][3]


def test_bidirectional_mask_matters(tiny_gemma3, references):
    # the oracle is not vacuous: with causal image tokens some prompt's output leaves HF's
    llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    _runner(llm).image_spans = False
    batch = [1, 2, 4]
    assert any(got != references[i][3] for i, got in zip(batch, _outputs(llm, references, batch)))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("i", range(len(CASES)))
def test_alone_matches_hf(tiny_gemma3, references, i, backend):
    llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=8, attention_backend=backend)
    _check(llm, references, [i])
    assert _runner(llm).encoder_cache.num_encoded == CASES[i][1]


@pytest.mark.slow
def test_bfloat16_cpu_backend_equals_torch_reference(tiny_gemma3, references):
    # a bfloat16 model on the cpu backend takes the torch reference path (it crashed there before), images included
    outs = []
    for backend in ("cpu", "torch"):
        llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=8, dtype="bfloat16",
                  attention_backend=backend)
        outs.append(_outputs(llm, references, [2, 0, 1]))
    assert outs[0] == outs[1]
    assert all(len(o) == MAX_TOKENS for o in outs[0])


@pytest.mark.slow
def test_quantized_kv_cache_cpu_backend_equals_torch_reference(tiny_gemma3, references):
    # an int8 KV cache: the cpu backend's image requests dequantize the kernel's layout, the torch reference its own;
    # 20-token steps put images in context chunks
    outs = []
    for backend in ("cpu", "torch"):
        llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=8, kv_cache_dtype="int8",
                  attention_backend=backend, max_num_batched_tokens=20, enable_prefix_caching=False)
        outs.append(_outputs(llm, references, [2, 1, 4]))
    assert outs[0] == outs[1]


def test_batch_mixed_with_text_only(tiny_gemma3, references):
    llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=8, enable_prefix_caching=False)
    batch = [i % len(CASES) for i in range(16)]
    _check(llm, references, batch)
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)


def test_chunked_prefill_never_splits_an_image(tiny_gemma3, references):
    # 18-token steps: every prompt with an image is chunked, and each 16-token image run lands whole in one step
    llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=4, max_num_batched_tokens=18,
              enable_prefix_caching=False)
    runner = _runner(llm)
    chunks: list[tuple[int, int, list[tuple[int, int]]]] = []  # (first, end, image runs of its request)
    prepare = runner._prepare

    def recording_prepare(so):
        step = prepare(so)
        for rid, c, n in zip(step.req_ids, step.computed.tolist(), step.counts.tolist()):
            runs = [(f.offset, f.offset + f.length) for f in runner.encoder_cache.features.get(rid, ())]
            chunks.append((c, c + n, runs))
        return step

    runner._prepare = recording_prepare
    batch = [0, 1, 2, 4, 2, 3]
    _check(llm, references, batch)
    assert runner.encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)
    with_images = [(first, end, runs) for first, end, runs in chunks if runs and end - first > 1]
    assert any(first > 0 for first, _, _ in with_images)  # prompts with images were chunked
    for first, end, runs in with_images:  # no chunk starts or ends strictly inside an image run
        assert not any(s < first < e or s < end < e for s, e in runs), (first, end, runs)


def test_budget_below_one_image_is_refused(tiny_gemma3):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, max_num_batched_tokens=GEMMA3_TOKENS_PER_IMAGE - 1)


def test_preemption_recomputes_without_reencoding(tiny_gemma3, references):
    llm = LLM(tiny_gemma3, max_model_len=128, block_size=4, num_gpu_blocks_override=70, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    batch = [2, 1, 2, 4, 2, 1]
    _check(llm, references, batch)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert _runner(llm).encoder_cache.num_encoded == sum(CASES[i][1] for i in batch)


def test_prefix_cache_no_cross_talk_and_hits(tiny_gemma3, gemma3_hf):
    llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=4)
    text = f"Here: {IMG} What is in this picture? Answer in detail please."
    a, b = make_image(101), make_image(202)
    for image in (a, b):  # same text, different image: each its own HF output (no blocks shared over the image)
        out = llm.generate(_request(text, [image]), GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_llava_greedy(gemma3_hf, text, [image], MAX_TOKENS)[1]
    first = out.prompt_token_ids.index(gemma3_hf[0].config.image_token_id)
    assert out.num_cached_tokens == first // 4 * 4  # b's blocks before the image were hits; none over it
    again = llm.generate(_request(text, [b]), GREEDY, use_tqdm=False)[0]  # the same image again: a hit over it
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.num_cached_tokens >= first + GEMMA3_TOKENS_PER_IMAGE
    assert _runner(llm).encoder_cache.num_encoded == 2  # the full hit over the image never encodes it


def test_prefix_hit_ending_inside_an_image(tiny_gemma3, gemma3_hf):
    # same image, other text after it: the hit ends inside the placeholder run; the run's tail is computed in one
    # step and attends to the cached head (computed with the whole image) and to itself bidirectionally
    llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    image = make_image(303)
    for tail in (" Is it red?", " Is it blue or green?"):
        out = llm.generate(_request(f"look {IMG}" + tail, [image]), GREEDY, use_tqdm=False)[0]
        ids, ref = hf_llava_greedy(gemma3_hf, f"look {IMG}" + tail, [image], MAX_TOKENS)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == ref
    start = ids.index(gemma3_hf[0].config.image_token_id)
    assert start < out.num_cached_tokens < start + GEMMA3_TOKENS_PER_IMAGE
    assert _runner(llm).encoder_cache.num_encoded == 2


def test_chat_with_image_part_matches_hf(tiny_gemma3, gemma3_hf):
    from tests.multimodal.test_llava_server import data_url

    llm = LLM(tiny_gemma3, kv_cache_memory="16MiB", max_model_len=256, block_size=8)
    image = make_image(5)
    conversation = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                 {"type": "text", "text": "Describe it."}]}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    text = gemma3_hf[1].tokenizer.apply_chat_template([{"role": "user", "content": f"{IMG}\nDescribe it."}],
                                                      tokenize=False, add_generation_prompt=True)
    ids, ref = hf_llava_greedy(gemma3_hf, text, [image], MAX_TOKENS, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref
