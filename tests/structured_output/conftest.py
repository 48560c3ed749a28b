"""Fixtures for structured-output tests: one LLM per backend on the embedded SmolLM2, chat-style prompts."""

from __future__ import annotations

import pytest

from pagemill import LLM


def chat_prompt(text: str) -> str:
    """SmolLM2's ChatML rendering of one user message."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


_LLMS: dict[str, LLM] = {}


@pytest.fixture(scope="session")
def so_llm(smol_path):
    """LLM for a backend (auto | xgrammar | guidance), built once per session."""

    def get(backend: str = "auto") -> LLM:
        if backend not in _LLMS:
            _LLMS[backend] = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024, max_num_seqs=64,
                                 structured_outputs_config={"backend": backend})
        return _LLMS[backend]

    return get


def assert_no_leak(llm: LLM) -> None:
    """Every KV block is back in the pool and no request is left in the engine."""
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.engine_core.structured_output_manager.num_live == 0
