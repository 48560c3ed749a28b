"""Engine logprobs -> the chat (`content` list) and legacy completions (parallel lists) formats."""

from __future__ import annotations

import math
from collections.abc import Callable

from pagemill.entrypoints.openai.protocol import (ChatCompletionLogProbs, ChatLogProb, ChatLogProbsContent,
                                                  CompletionLogProbs, PromptLogprob)
from pagemill.outputs import Logprob, PromptLogprobs, SampleLogprobs


def _finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def _top(position: dict[int, Logprob], top_n: int, wanted: frozenset[int] = frozenset()) -> list[tuple[int, Logprob]]:
    """The top-N candidates of a position, best first, then the tokens asked for by id (logprob_token_ids)."""
    ranked = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n]
    ranked.sort(key=lambda x: x[1].rank)  # type: ignore[arg-type, return-value]
    ranked = ranked[:top_n]
    if wanted:
        seen = {t for t, _ in ranked}
        ranked += [(t, position[t]) for t in sorted(wanted) if t in position and t not in seen]
    return ranked


def _label(token_id: int, lp: Logprob | None, as_ids: bool, token_text: Callable[[int], str] | None) -> str:
    """A token as the response names it: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
    if as_ids:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return token_text(token_id) if token_text is not None else ""


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, top_n: int,
                  as_ids: bool = False, wanted: frozenset[int] = frozenset()) -> ChatCompletionLogProbs:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""
    content = []
    for tok, position in zip(token_ids, logprobs):
        chosen = position[tok]
        text = _label(tok, chosen, as_ids, None)
        top = [ChatLogProb(token=(t := _label(tid, lp, as_ids, None)), logprob=_finite(lp.logprob),
                           bytes=list(t.encode())) for tid, lp in _top(position, top_n, wanted)]
        content.append(ChatLogProbsContent(token=text, logprob=_finite(chosen.logprob), bytes=list(text.encode()),
                                           top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], top_n: int,
                        text_offset: int = 0, as_ids: bool = False,
                        token_text: Callable[[int], str] | None = None,
                        wanted: frozenset[int] = frozenset()) -> CompletionLogProbs:
    """`choices[i].logprobs` of a legacy completion; offsets start at `text_offset`. A position without logprobs
    (the prompt's first token under echo) gets None, its text from `token_text`."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    offset = text_offset
    for tok, position in zip(token_ids, logprobs):
        chosen = position.get(tok) if position is not None else None
        text = _label(tok, chosen, as_ids, token_text)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if position is None or chosen is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_finite(chosen.logprob))
        top = {_label(t, lp, as_ids, token_text): _finite(lp.logprob) for t, lp in _top(position, top_n, wanted)} \
            if top_n or wanted else {}
        top.setdefault(text, _finite(chosen.logprob))
        tops.append(top)
    # Built with every field set, so that exclude_unset (streamed chunks) keeps them.
    return CompletionLogProbs(text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=tops)


def prompt_logprobs_json(logprobs: PromptLogprobs | None) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt position None (the first) or {token id: logprob, rank, text}."""
    if logprobs is None:
        return None
    return [None if pos is None else {t: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank,
                                                       decoded_token=lp.decoded_token) for t, lp in pos.items()}
            for pos in logprobs]
