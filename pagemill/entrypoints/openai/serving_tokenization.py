"""POST /tokenize and /detokenize (vLLM's extra endpoints)."""

from __future__ import annotations

from typing import Any

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.prompt_preparer import PromptPreparer
from pagemill.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                                  TokenizeResponse)
from pagemill.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization:
    """Tokenizes prompts or chat conversations, and decodes token ids."""

    def __init__(self, tokenizer: Any, models: OpenAIServingModels, prompts: PromptPreparer) -> None:
        self.tokenizer = tokenizer
        self.models = models
        self.prompts = prompts
        self.vocab_size = len(tokenizer)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Token ids of `prompt`, or of `messages` rendered with the chat template."""
        self.models.resolve(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give exactly one of prompt and messages.", 400, "prompt")
        if request.messages is not None:
            if not request.messages:
                raise OpenAIError("messages must not be empty.", 400, "messages")
            tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
            ids = await self.prompts.render([m.to_dict() for m in request.messages], request.chat_template,
                                            request.add_generation_prompt, request.continue_final_message,
                                            request.chat_template_kwargs, tools)
        else:
            ids = await self.prompts.encode(request.prompt, request.add_special_tokens, "prompt")
        return TokenizeResponse(count=len(ids), max_model_len=self.models.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of the token ids."""
        self.models.resolve(request.model)
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(f"tokens must be in [0, {self.vocab_size}), got {', '.join(map(str, bad))}.", 400,
                              "tokens")
        if getattr(self.tokenizer, "is_stub", False):
            raise OpenAIError("tokens cannot be detokenized: the server runs with --skip-tokenizer-init.", 400,
                              "tokens")
        return DetokenizeResponse(prompt=await self.prompts.worker.run(self.tokenizer.decode, request.tokens))
