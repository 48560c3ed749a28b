"""Prompt text and chat conversations to token ids for the endpoints, off the event loop and within the limits."""

from __future__ import annotations

from typing import Any

from pagemill.entrypoints.chat_utils import ChatRenderer, Conversation, Tools
from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.prompt_worker import PromptWorker, TimeLimitExceeded
from pagemill.entrypoints.openai.server_limits import ServerLimits
from pagemill.loader.tokenizer import SKIP_TOKENIZER_MESSAGE, is_no_tokenizer

# Tokens beyond max_model_len that a text prefix must reach before the whole text is declared too long (the last
# word of a cut text may tokenize differently than in the whole).
_PREFIX_MARGIN_TOKENS = 64


class PromptPreparer:
    """Tokenizes prompts and renders chat templates in worker threads; a text far beyond the context is rejected
    from a prefix, a request's own chat template only with --trust-request-chat-template, and any rendering is
    stopped after the limit."""

    def __init__(self, tokenizer: Any, renderer: ChatRenderer, max_model_len: int, limits: ServerLimits,
                 worker: PromptWorker | None = None) -> None:
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.max_model_len = max_model_len
        self.limits = limits
        self.worker = worker or PromptWorker()
        # No token is longer than this many characters: a text of more than (max_model_len + margin) times as many
        # characters is checked on a prefix of that length first.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.prefix_chars = (max_model_len + _PREFIX_MARGIN_TOKENS) * max(longest, 1)

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if is_no_tokenizer(self.tokenizer):
            raise OpenAIError(f"{param} is text, but {SKIP_TOKENIZER_MESSAGE}.", 400, param)
        if len(text) > self.prefix_chars:
            head = self.tokenizer.encode(text[:self.prefix_chars], add_special_tokens=add_special_tokens)
            if len(head) >= self.max_model_len + _PREFIX_MARGIN_TOKENS:
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} "
                    f"is longer than that: its first {self.prefix_chars} characters alone are {len(head)} tokens. "
                    f"Please reduce the length of the {param}.", 400, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of a prompt text (in a worker thread); a 400 naming `param` for a text far over the context."""
        if not text:
            return []
        return await self.worker.run(self._encode, text, add_special_tokens, param)

    def check_request_template(self, chat_template: str | None) -> None:
        """400 for a request's own chat template unless the server trusts them."""
        if chat_template is not None and not self.limits.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is refused by this server (start it with "
                              "--trust-request-chat-template to allow request chat templates).", 400,
                              "chat_template")

    async def render(self, conversation: Conversation, chat_template: str | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: dict[str, Any] | None = None, tools: Tools | None = None,
                     add_special_tokens: bool = False) -> list[int]:
        """Token ids of a rendered conversation, rendered in a thread of its own and stopped (a 400) after the
        time limit; `add_special_tokens`: the tokenizer's own (e.g. BERT's [CLS] / [SEP]) around the text too."""
        from pagemill.multimodal.chat import first_image_part

        image_part = first_image_part(conversation)
        if image_part is not None:  # (chat completions take images through render_multimodal)
            raise OpenAIError(f"{image_part}: images are taken by /v1/chat/completions only.", 400, image_part)
        text = await self._render_text(conversation, chat_template, add_generation_prompt, continue_final_message,
                                       chat_template_kwargs, tools)
        # the template has the special tokens (unless the caller asks for the tokenizer's as well)
        return await self.worker.run(self._encode, text, add_special_tokens, "messages")

    async def _render_text(self, conversation: Conversation, chat_template: str | None, add_generation_prompt: bool,
                           continue_final_message: bool, chat_template_kwargs: dict[str, Any] | None,
                           tools: Tools | None) -> str:
        """The conversation rendered to text by the chat template, in a worker thread under the time limit."""
        self.check_request_template(chat_template)
        if is_no_tokenizer(self.tokenizer):
            raise OpenAIError(f"messages cannot be rendered: {SKIP_TOKENIZER_MESSAGE}.", 400, "messages")
        try:
            return await self.worker.run_limited(
                self.limits.chat_template_timeout_s, self.renderer.render_text, conversation, chat_template,
                add_generation_prompt, continue_final_message, chat_template_kwargs, tools)
        except TimeLimitExceeded:
            param = "chat_template" if chat_template is not None else "messages"
            raise OpenAIError(f"The chat template did not render the messages within "
                              f"{self.limits.chat_template_timeout_s:g} s (--chat-template-timeout).", 400,
                              param) from None

    async def render_multimodal(self, conversation: Conversation, mm_processor: Any, chat_template: str | None = None,
                                add_generation_prompt: bool = True, continue_final_message: bool = False,
                                chat_template_kwargs: dict[str, Any] | None = None, tools: Tools | None = None
                                ) -> tuple[list[int], list[Any]]:
        """(token ids, image features) of a conversation with image parts: the images decoded, checked and
        processed by the model's HF processor in a worker thread; a 400 naming the image's field for a bad one."""
        from pagemill.multimodal.chat import take_images
        from pagemill.multimodal.image import MultiModalInputError

        try:
            conversation, sources = take_images(conversation, mm_processor.chat_image_text if mm_processor else None)
            text = await self._render_text(conversation, chat_template, add_generation_prompt, continue_final_message,
                                           chat_template_kwargs, tools)
            return await self.worker.run(mm_processor.process_chat, text, sources)
        except MultiModalInputError as e:
            raise OpenAIError(e.message, 400, e.param) from None
        except ValueError as e:
            raise OpenAIError(str(e), 400, "messages") from None
