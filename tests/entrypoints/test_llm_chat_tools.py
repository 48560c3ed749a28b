"""The offline LLM.chat with tools and the shipped ChatML tools template (as vLLM's LLM.chat(tools=...))."""

from __future__ import annotations

from pagemill import SamplingParams
from tests.entrypoints.test_chat_utils import TOOL_CONVERSATION, TOOLS


def test_llm_chat_renders_tools(smol_llm):
    ids = smol_llm.render_chat(TOOL_CONVERSATION, "chatml_tools", tools=TOOLS)
    text = smol_llm.get_tokenizer().decode(ids)
    assert "<tools>" in text and "get_weather" in text and "<tool_response>\n18C\n</tool_response>" in text
    (out,) = smol_llm.chat(TOOL_CONVERSATION, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False,
                           chat_template="chatml_tools", tools=TOOLS)
    assert out.prompt_token_ids == ids
    assert len(smol_llm.render_chat(TOOL_CONVERSATION[:1], "chatml_tools")) < len(
        smol_llm.render_chat(TOOL_CONVERSATION[:1], "chatml_tools", tools=TOOLS))
