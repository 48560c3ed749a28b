"""Incremental detokenization that is correct for multi-byte UTF-8 and byte-level BPE."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns tokens into text one at a time (tokenizers' DecodeStream buffers incomplete UTF-8)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Prime with the prompt's tail so that the first output token gets its leading space right.
        for tok in prompt_token_ids[-4:]:
            self._stream.step(self._backend, tok)

    def step(self, token_id: int) -> str:
        """The text that `token_id` completes ('' while a multi-byte character is still partial)."""
        return self._stream.step(self._backend, token_id) or ""
