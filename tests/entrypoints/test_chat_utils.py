"""Chat template rendering: the GGUF's own template, `--chat-template FILE`, per-request templates, errors."""

from __future__ import annotations

import pytest

from pagemill.entrypoints.chat_utils import ChatRenderer, ChatTemplateError, load_chat_template
from pagemill.entrypoints.openai.protocol import ChatMessage
from pagemill.loader.tokenizer import load_tokenizer

MESSAGES = [m.to_dict() for m in (
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]))]


@pytest.fixture(scope="module")
def tokenizer(smol_path):
    return load_tokenizer(smol_path, smol_path)


def test_model_template_from_gguf(tokenizer):
    r = ChatRenderer(tokenizer)
    text = r.render_text(MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert r.render_text(MESSAGES, add_generation_prompt=False).endswith("there<|im_end|>\n")
    ids = r.render(MESSAGES)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_continue_final_message(tokenizer):
    msgs = MESSAGES + [{"role": "assistant", "content": "Hello! I"}]
    text = ChatRenderer(tokenizer).render_text(msgs, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello! I")
    with pytest.raises(ChatTemplateError) as e:
        ChatRenderer(tokenizer).render_text(MESSAGES, continue_final_message=True)
    assert e.value.param == "continue_final_message"


def test_chat_template_file_overrides_the_model_one(tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    r = ChatRenderer(tokenizer, load_chat_template(str(path)))
    assert r.render_text(MESSAGES) == "[system] Be brief.\n[user] Hi\nthere\n[assistant] "
    # a request's own template wins over the server's
    assert r.render_text(MESSAGES, chat_template="{{ messages[-1]['content'] }}") == "Hi\nthere"
    with pytest.raises(ValueError, match="does not exist"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"


def test_broken_templates_are_400s(tokenizer):
    r = ChatRenderer(tokenizer)
    with pytest.raises(ChatTemplateError) as e:
        r.render_text(MESSAGES, chat_template="{% if %}")
    assert e.value.param == "chat_template"
    with pytest.raises(ChatTemplateError) as e:
        r.render_text(MESSAGES, chat_template="{{ raise_exception('no system messages') }}")
    assert "no system messages" in e.value.message
    no_template = ChatRenderer(tokenizer)
    no_template.default_template = None
    with pytest.raises(ChatTemplateError) as e:
        no_template.render_text(MESSAGES)
    assert e.value.param == "chat_template" and "--chat-template" in e.value.message


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CONVERSATION = [m.to_dict() for m in (
    ChatMessage(role="user", content="Weather in Oslo and Rome?"),
    ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "c2", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]),
    ChatMessage(role="tool", tool_call_id="c1", content="-3C"),
    ChatMessage(role="tool", tool_call_id="c2", content="18C"))]


def test_chatml_tools_template_without_tools_is_smollm2s(tokenizer):
    shipped = ChatRenderer(tokenizer, load_chat_template("chatml_tools"))
    for conversation in (MESSAGES, MESSAGES[1:], MESSAGES + [{"role": "assistant", "content": "Hello"}]):
        assert shipped.render_text(conversation) == ChatRenderer(tokenizer).render_text(conversation)
    assert load_chat_template("tool_chat_template_chatml") == load_chat_template("chatml_tools")
    # a request may name a shipped template too (never a server file)
    assert "<tools>" in ChatRenderer(tokenizer).render_text(MESSAGES, chat_template="chatml_tools", tools=TOOLS)


def test_chatml_tools_template_renders_tools_calls_and_results(tokenizer):
    r = ChatRenderer(tokenizer, load_chat_template("chatml_tools"))
    text = r.render_text(TOOL_CONVERSATION, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city"' in text
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
            "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n"
            "</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\n-3C\n</tool_response>\n<tool_response>\n18C\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    # the model's own template has no tools branch: the tools are simply not shown
    assert "<tools>" not in ChatRenderer(tokenizer).render_text(TOOL_CONVERSATION[:1], tools=TOOLS)
    custom = r.render_text(TOOL_CONVERSATION[:1], chat_template_kwargs={"default_system_message": "Be terse."})
    assert custom.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
