"""float16 / bfloat16 matmuls and KV caches against the float32 reference: top-1 agreement, logprob error."""

from __future__ import annotations

import pytest
import torch

from pagemill import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXTS = [
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city and its "
    "slow growth into a republic, then an empire that ruled the Mediterranean world for centuries.",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"
    "    left = [x for x in arr if x < pivot]\n    return quicksort(left) + [pivot]",
    "Photosynthesis converts light energy into chemical energy. In plants, this process takes place in the "
    "chloroplasts, where chlorophyll absorbs mostly blue and red light.",
]


# bfloat16 keeps 8 mantissa bits: ~98-99% top-1 here, below float16's 99+% (it is kept for range, not speed).
@pytest.mark.parametrize("linear_dtype,kv_cache_dtype,quantization,min_agree,max_err", [
    ("float16", "auto", "none", 0.99, 0.01), ("bfloat16", "auto", "none", 0.975, 0.03),
    ("auto", "float16", "none", 0.99, 0.01), ("float16", "float16", "none", 0.99, 0.01),
])
def test_reduced_precision_agrees_with_float32(smol_path, smol_hf, linear_dtype, kv_cache_dtype, quantization,
                                               min_agree, max_err):
    model, tok = smol_hf
    llm = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, linear_dtype=linear_dtype,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization, enable_prefix_caching=False)
    agree = total = 0
    errors = []
    for text in TEXTS:
        ids = tok.encode(text)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for pos in range(1, len(ids)):
            d = out.prompt_logprobs[pos]
            ours_top1 = next(t for t, lp in d.items() if lp.rank == 1)
            agree += int(ours_top1 == int(ref[pos - 1].argmax()))
            total += 1
            errors.append(abs(d[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()))
    agreement = agree / total
    mean_err = sum(errors) / len(errors)
    print(f"linears {linear_dtype}, KV cache {kv_cache_dtype}, quantization {quantization}: top-1 agreement {agreement:.4f}, mean |dlogprob| {mean_err:.4f} over {total} positions")
    assert agreement >= min_agree
    assert mean_err < max_err
