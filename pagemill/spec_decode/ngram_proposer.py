"""Prompt-lookup (n-gram) drafting, vLLM's `method="ngram"`: copy what followed an earlier occurrence of the
context's last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the context's last n tokens are searched for earlier in
the context; on the longest n that matches, the tokens that followed that occurrence are proposed (at most
`max_tokens`, fewer where the occurrence is near the end of the context: proposals never wrap around).

Choices:
- An occurrence must start before the suffix itself does (it is never the suffix), but it may overlap it, as in
  vLLM (in "a b a b a b" the suffix "a b" occurs two tokens earlier, overlapping "b a b"); so periodic text is
  found at its shortest period.
- Among the occurrences of the longest n, the most recent one that is followed by max_tokens tokens wins (vLLM
  v1's KMP search keeps the earliest): the nearest repetition is the likeliest to be continued the same way (code
  being edited, a list being extended). When none has that much room (an occurrence near the end of the context,
  periodic text: in "7 7 7 7" the most recent "7 7" is followed by one token only), the earliest one wins, whose
  proposal is the longest; it is still truncated at the end of the context, never wrapped around.
- Stateless: one pass of vectorised numpy per call, O(context) with a small constant; the last token's matches are
  found with one comparison over the context, then each longer n only filters those candidates.
"""

from __future__ import annotations

import numpy as np

from pagemill.config import SpeculativeConfig


class NgramProposer:
    """vLLM's prompt lookup: the tokens after an earlier occurrence of the longest matching n-gram (the most recent
    one with room for a full draft, else the earliest)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, req_id: str, context: np.ndarray, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed an earlier occurrence of the longest matching suffix."""
        n = context.shape[0]
        max_n = min(self.max_n, n - 1)  # an occurrence must start before the suffix does
        if max_tokens <= 0 or max_n < self.min_n:
            return []
        # Candidate occurrences, by the position of their last token: every earlier copy of the last token.
        ends = np.flatnonzero(context[:-1] == context[-1])
        if ends.size == 0:
            return []
        best_len, best_ends = 1, ends
        for j in range(1, max_n):
            # Keep the candidates whose match extends to j + 1 tokens (candidates with end < j cannot).
            ends = ends[ends >= j]
            ends = ends[context[ends - j] == context[n - 1 - j]]
            if ends.size == 0:
                break
            best_len, best_ends = j + 1, ends
        if best_len < self.min_n:
            return []
        # best_ends is sorted: the most recent occurrence followed by max_tokens tokens, else the earliest one.
        full = int(np.searchsorted(best_ends, n - max_tokens, side="left"))
        start = int(best_ends[full - 1] if full > 0 else best_ends[0]) + 1
        return context[start:start + max_tokens].tolist()

    def remove_request(self, req_id: str, finished: bool) -> None:
        """Nothing to drop: the n-gram proposer keeps no per-request state."""
