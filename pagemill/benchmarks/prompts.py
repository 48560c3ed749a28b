"""Build prompts of an exact token length by cutting slices of the built-in corpus."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pagemill.benchmarks.corpus import CORPUS_TEXT


class PromptBuilder:
    """Cuts corpus token slices so that `encode(decode(ids)) == ids` and `len(ids)` is exact."""

    def __init__(self, tokenizer: Any, corpus: str = CORPUS_TEXT, max_attempts: int = 16) -> None:
        self.tokenizer = tokenizer
        self.max_attempts = max_attempts
        self.stream: list[int] = self.encode(corpus.replace("\n", " ") + " ")
        # Slices start where a word starts (a token decoding to " word"): a stable BPE boundary.
        self.word_starts = [i for i, t in enumerate(self.stream) if self.decode([t]).startswith(" ")]
        if not self.word_starts:
            self.word_starts = list(range(len(self.stream)))

    def encode(self, text: str) -> list[int]:
        """Tokenize without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenize exactly (no special-token skipping, no space clean-up)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def corpus_slice(self, n: int, rng: np.random.Generator) -> list[int]:
        """`n` consecutive corpus tokens from a random word start, wrapping around the corpus."""
        start = self.word_starts[int(rng.integers(len(self.word_starts)))]
        size = len(self.stream)
        return [self.stream[(start + i) % size] for i in range(n)]

    def build(self, num_tokens: int, rng: np.random.Generator,
              prefix_ids: Sequence[int] = ()) -> tuple[str, list[int]]:
        """Return (text, ids) with `len(ids) == num_tokens`, starting with `prefix_ids`.

        Tries fresh slices until the text re-tokenizes to the same ids; if that never happens the
        ids (exact length) are returned with their decoded text.
        """
        prefix = list(prefix_ids)
        need = num_tokens - len(prefix)
        if need < 0:
            raise ValueError(f"prompt length {num_tokens} is shorter than its prefix ({len(prefix)})")
        ids = prefix + self.corpus_slice(need, rng)
        for _ in range(self.max_attempts):
            text = self.decode(ids)
            if self.encode(text) == ids:
                return text, ids
            ids = prefix + self.corpus_slice(need, rng)
        return self.decode(ids), ids
