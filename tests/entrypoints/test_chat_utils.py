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
