"""Fixtures for structured-output tests: one LLM per backend on the embedded SmolLM2, chat-style prompts."""

from __future__ import annotations

import pytest

from pagemill import LLM


def chat_prompt(text: str) -> str:
    """SmolLM2's ChatML rendering of one user message."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def so_llm(smol_path) -> LLM:
    """One engine (backend auto) for the structured-output tests; a request picks another backend with
    StructuredOutputsParams(_backend=...), the field the engine itself fills in."""
    return LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024, max_num_seqs=64,
               structured_outputs_config={"backend": "auto"})


def assert_no_leak(llm: LLM) -> None:
    """Every KV block is back in the pool and no request is left in the engine."""
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.engine_core.structured_output_manager.num_live == 0
