"""Engine logprobs -> the chat (`content` list) and legacy completions (parallel lists) formats."""

from __future__ import annotations

import math

from pagemill.entrypoints.openai.protocol import (ChatCompletionLogProbs, ChatLogProb, ChatLogProbsContent,
                                                  CompletionLogProbs)
from pagemill.outputs import Logprob, SampleLogprobs


def _finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def _top(position: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    """The top-N candidates of a position, best first."""
    ranked = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n]
    ranked.sort(key=lambda x: x[1].rank)  # type: ignore[arg-type, return-value]
    return ranked[:top_n]


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, top_n: int) -> ChatCompletionLogProbs:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""
    content = []
    for tok, position in zip(token_ids, logprobs):
        chosen = position[tok]
        text = _text(chosen)
        top = [ChatLogProb(token=_text(lp), logprob=_finite(lp.logprob), bytes=list(_text(lp).encode()))
               for _, lp in _top(position, top_n)]
        content.append(ChatLogProbsContent(token=text, logprob=_finite(chosen.logprob), bytes=list(text.encode()),
                                           top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def completion_logprobs(token_ids: list[int], logprobs: SampleLogprobs, top_n: int,
                        text_offset: int = 0) -> CompletionLogProbs:
    """`choices[i].logprobs` of a legacy completion; offsets start at `text_offset`."""
    out = CompletionLogProbs()
    offset = text_offset
    for tok, position in zip(token_ids, logprobs):
        chosen = position[tok]
        text = _text(chosen)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(chosen.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        top = {_text(lp): _finite(lp.logprob) for _, lp in _top(position, top_n)} if top_n else {}
        top.setdefault(text, _finite(chosen.logprob))
        out.top_logprobs.append(top)
    return out
