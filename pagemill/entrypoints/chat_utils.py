"""The one chat renderer: conversations to token ids with the chat template (model's, `--chat-template`, or given).

Used by the offline `LLM.chat` and by the OpenAI server (chat completions, /tokenize).
"""

from __future__ import annotations

import os
from typing import Any

Conversation = list[dict[str, Any]]  # [{"role": ..., "content": ...}, ...]


class ChatTemplateError(ValueError):
    """A conversation the chat template cannot render; `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def load_chat_template(value: str | None) -> str | None:
    """A `--chat-template` argument: a file's contents, or the template itself if it is not a file."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # looks like a path, not a Jinja template
        raise ValueError(f"chat_template file {value!r} does not exist.")
    return value


class ChatRenderer:
    """Applies a chat template (a default one, or one per call) to conversations."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.default_template = chat_template or getattr(tokenizer, "chat_template", None)

    def render_text(self, conversation: Conversation, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text; raises ChatTemplateError for a conversation the template cannot render."""
        if not conversation:
            raise ChatTemplateError("messages must not be empty.", "messages")
        template = chat_template or self.default_template
        if template is None:
            raise ChatTemplateError("The model has no chat template: pass chat_template (the server: start it with "
                                    "--chat-template FILE or pass chat_template in the request).", "chat_template")
        if continue_final_message and conversation[-1].get("role") != "assistant":
            raise ChatTemplateError("continue_final_message needs the last message to be from the assistant.",
                                    "continue_final_message")
        try:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        except Exception as e:  # Jinja syntax or runtime errors are the request's fault
            param = "chat_template" if chat_template else "messages"
            raise ChatTemplateError(f"The chat template could not render the messages: {type(e).__name__}: {e}",
                                    param) from e

    def render(self, conversation: Conversation, chat_template: str | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the rendered conversation (the template carries the special tokens)."""
        text = self.render_text(conversation, chat_template, add_generation_prompt, continue_final_message,
                                chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)
