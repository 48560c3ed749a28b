"""The one chat renderer: conversations to token ids with the chat template (model's, `--chat-template`, or given).

Used by the offline `LLM.chat` and by the OpenAI server (chat completions, /tokenize).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

Conversation = list[dict[str, Any]]  # [{"role": ..., "content": ...}, ...]
Tools = list[dict[str, Any]]  # [{"type": "function", "function": {"name", "description", "parameters"}}, ...]


class ChatTemplateError(ValueError):
    """A conversation the chat template cannot render; `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


TEMPLATES_DIR = Path(__file__).parent / "templates"
# Short names for the templates shipped with pagemill (`--chat-template chatml_tools`).
BUILTIN_TEMPLATES = {"chatml_tools": "tool_chat_template_chatml.jinja"}


def builtin_template_path(name: str) -> Path | None:
    """The file of a shipped template, by short name or file name (with or without .jinja)."""
    file = BUILTIN_TEMPLATES.get(name, name if name.endswith(".jinja") else name + ".jinja")
    path = TEMPLATES_DIR / file
    return path if "/" not in file and path.is_file() else None


def load_chat_template(value: str | None) -> str | None:
    """A `--chat-template` argument: a file's contents, a shipped template's short name (chatml_tools), or the
    template itself if it is neither."""
    if value is None:
        return None
    builtin = builtin_template_path(value) if "{" not in value else None
    if builtin is not None and not os.path.isfile(value):
        return builtin.read_text(encoding="utf-8")
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # looks like a path, not a Jinja template
        raise ValueError(f"chat_template file {value!r} does not exist (shipped templates: "
                         f"{', '.join(BUILTIN_TEMPLATES)}).")
    return value


class ChatRenderer:
    """Applies a chat template (a default one, or one per call) to conversations."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.default_template = chat_template or getattr(tokenizer, "chat_template", None)

    def render_text(self, conversation: Conversation, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None, tools: Tools | None = None) -> str:
        """The prompt text (tools reach the template as its `tools` variable); raises ChatTemplateError for a
        conversation the template cannot render."""
        if not conversation:
            raise ChatTemplateError("messages must not be empty.", "messages")
        if chat_template is not None and "{" not in chat_template and builtin_template_path(chat_template):
            chat_template = builtin_template_path(chat_template).read_text(encoding="utf-8")  # a shipped one's name
        template = chat_template or self.default_template
        if template is None:
            raise ChatTemplateError("The model has no chat template: pass chat_template (the server: start it with "
                                    "--chat-template FILE or pass chat_template in the request).", "chat_template")
        if continue_final_message and conversation[-1].get("role") != "assistant":
            raise ChatTemplateError("continue_final_message needs the last message to be from the assistant.",
                                    "continue_final_message")
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **kwargs)
        except Exception as e:  # Jinja syntax or runtime errors are the request's fault
            param = "chat_template" if chat_template else "messages"
            raise ChatTemplateError(f"The chat template could not render the messages: {type(e).__name__}: {e}",
                                    param) from e

    def render(self, conversation: Conversation, chat_template: str | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None, tools: Tools | None = None) -> list[int]:
        """Token ids of the rendered conversation (the template carries the special tokens)."""
        text = self.render_text(conversation, chat_template, add_generation_prompt, continue_final_message,
                                chat_template_kwargs, tools)
        return self.tokenizer.encode(text, add_special_tokens=False)
