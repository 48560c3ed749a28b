"""Render conversations to token ids with the chat template (model's, `--chat-template`, or per request)."""

from __future__ import annotations

import os
from typing import Any

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.protocol import ChatMessage


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
    """Applies a chat template to OpenAI messages."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.default_template = chat_template or getattr(tokenizer, "chat_template", None)

    def render_text(self, messages: list[ChatMessage], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text; raises a 400 OpenAIError for a conversation the template cannot render."""
        template = chat_template or self.default_template
        if template is None:
            raise OpenAIError("The model has no chat template: start the server with --chat-template FILE "
                              "or pass chat_template in the request.", 400, "chat_template")
        if continue_final_message and messages[-1].role != "assistant":
            raise OpenAIError("continue_final_message needs the last message to be from the assistant.",
                              400, "continue_final_message")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        except OpenAIError:
            raise
        except Exception as e:  # Jinja syntax or runtime errors are the request's fault
            param = "chat_template" if chat_template else "messages"
            raise OpenAIError(f"The chat template could not render the messages: {type(e).__name__}: {e}",
                              400, param) from e

    def render(self, messages: list[ChatMessage], chat_template: str | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the rendered conversation (the template carries the special tokens)."""
        text = self.render_text(messages, chat_template, add_generation_prompt, continue_final_message,
                                chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)
