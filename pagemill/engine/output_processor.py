"""Front-end output processing: detokenize, stop strings, logprobs; n > 1 goes through parallel_sampling."""

from __future__ import annotations

import time
from typing import Any

from pagemill.engine.detokenizer import IncrementalDetokenizer
from pagemill.loader.tokenizer import is_no_tokenizer
from pagemill.engine.parallel_sampling import ParentRequest
from pagemill.messages import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreRequest, LogprobsLists
from pagemill.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                              RequestOutput)
from pagemill.sampling_params import RequestOutputKind, SamplingParams


def first_scheduled_time(events: list[EngineCoreEvent]) -> float | None:
    """The time of the first SCHEDULED event, if any."""
    return next((e.timestamp for e in events if e.type == EngineCoreEventType.SCHEDULED), None)


class RequestState:
    """Everything the front end tracks for one sequence while it is generated."""

    def is_stop_token(self, token: int) -> bool:
        """Whether `token` ends the sequence by itself (EOS unless ignore_eos, or a stop_token_ids entry)."""
        p = self.params
        return (token == self.eos_token_id and not p.ignore_eos) or token in p.all_stop_token_ids

    def __init__(self, request_id: str, parent: ParentRequest | None, index: int, prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams, tokenizer: Any, queue: Any,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.queue = queue
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens) \
            if params.detokenize else None
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            [None] if params.prompt_logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.eos_token_id: int | None = None
        self.sent_tokens = 0
        self.sent_text = 0
        self.sent_logprobs = 0
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    def update_from_events(self, events: list[EngineCoreEvent]) -> None:
        """Record scheduling and preemption times the engine core reported."""
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = first_scheduled_time(events)
        self.metrics.num_preemptions += sum(e.type == EngineCoreEventType.PREEMPTED for e in events)

    def _check_stop_strings(self, new_text_len: int) -> bool:
        """Truncate at the first stop string that the new text completes."""
        if not self.params.stop or not new_text_len:
            return False
        start = max(0, len(self.text) - new_text_len - self.max_stop_len + 1)
        best = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        self.finish_reason, self.stop_reason = "stop", s
        return True

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        """The CompletionOutput to report now (a delta or everything so far)."""
        finished = self.finish_reason is not None
        hold = 0 if finished or not self.max_stop_len else self.max_stop_len - 1
        if kind == RequestOutputKind.DELTA:
            text_end = max(self.sent_text, len(self.text) - hold)
            text = self.text[self.sent_text:text_end]
            tokens = self.token_ids[self.sent_tokens:]
            lps = self.logprobs[self.sent_logprobs:] if self.logprobs is not None else None
            self.sent_text, self.sent_tokens = text_end, len(self.token_ids)
            self.sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        else:
            text = self.text if finished else self.text[: max(0, len(self.text) - hold)]
            tokens, lps = list(self.token_ids), self.logprobs
        return CompletionOutput(self.index, text, tokens, self.cumulative_logprob, lps, self.finish_reason,
                                self.stop_reason)


class OutputProcessor:
    """Applies engine-core outputs to request states and builds RequestOutputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.no_tokenizer = is_no_tokenizer(tokenizer)
        self.states: dict[str, RequestState] = {}  # by sequence id
        self.parent_requests: dict[str, ParentRequest] = {}  # n > 1: by user request id
        self._token_text: dict[int, str] = {}

    def add_request(self, prompt: str | None, req: EngineCoreRequest, queue: Any = None) -> list[EngineCoreRequest]:
        """Start tracking a request (n > 1: one state per sequence); returns the requests to send to the core."""
        parent = ParentRequest.from_params(req.request_id, req.sampling_params)
        children = [req] if parent is None else parent.child_requests(req)
        if parent is not None:
            self.parent_requests[req.request_id] = parent
        for index, child in enumerate(children):
            self.states[child.request_id] = RequestState(child.request_id, parent, index, prompt, req.prompt_token_ids,
                                                         child.sampling_params, self.tokenizer, queue, req.arrival_time)
            self.states[child.request_id].eos_token_id = req.eos_token_id
        return children

    def has_unfinished_requests(self) -> bool:
        """True while any sequence is tracked."""
        return bool(self.states)

    def sequence_ids(self, request_ids: list[str]) -> list[str]:
        """The sequence ids of user requests (their children for n > 1) that are still tracked."""
        out = []
        for rid in request_ids:
            parent = self.parent_requests.get(rid)
            out.extend(sid for sid in (parent.child_ids if parent is not None else [rid]) if sid in self.states)
        return out

    def abort_requests(self, request_ids: list[str]) -> list[RequestState]:
        """Stop tracking user requests (all their sequences) or single sequences; returns the dropped states."""
        seq_ids = self.sequence_ids(request_ids)
        for rid in request_ids:
            self.parent_requests.pop(rid, None)
        return [s for sid in seq_ids if (s := self.states.pop(sid, None)) is not None]

    def clear(self) -> None:
        """Forget everything (the engine is gone)."""
        self.states.clear()
        self.parent_requests.clear()

    def _decode_token(self, tok: int) -> str | None:
        if self.no_tokenizer:
            return None  # skip_tokenizer_init: logprobs carry token ids only
        text = self._token_text.get(tok)
        if text is None:
            text = self._token_text[tok] = self.tokenizer.decode([tok])
        return text

    def _to_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        out = []
        for pos, (ids, lps, rank) in enumerate(zip(lists.token_ids, lists.logprobs, lists.ranks)):
            d = {ids[0]: Logprob(lps[0], rank, self._decode_token(ids[0]))}
            extra = lists.extra_ranks[pos] if lists.extra_ranks else []
            num_top = len(ids) - 1 - len(extra)
            for r, (t, lp) in enumerate(zip(ids[1:1 + num_top], lps[1:1 + num_top]), start=1):
                if t not in d:
                    d[t] = Logprob(lp, r, self._decode_token(t))
            for t, lp, r in zip(ids[1 + num_top:], lps[1 + num_top:], extra):
                if t not in d:
                    d[t] = Logprob(lp, r, self._decode_token(t))
            out.append(d)
        return out

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(request outputs to deliver, ids the core must abort because a stop string matched)."""
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        now = time.monotonic()
        for eco in outputs:
            state = self.states.get(eco.request_id)
            if state is None:
                continue
            if eco.pooling_output is not None:  # a pooling request: its one output, once its prompt is computed
                out = self._pooling_output(state, eco, now)
                del self.states[eco.request_id]
                if state.queue is not None:
                    state.queue.put_nowait(out)
                else:
                    results.append(out)
                continue
            if eco.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._to_dicts(eco.new_prompt_logprobs))
            state.num_cached_tokens = eco.num_cached_tokens
            if eco.events:
                state.update_from_events(eco.events)
            if eco.new_token_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                state.metrics.last_token_time = now
            new_len = 0
            # A request stopped by a stop token (EOS or stop_token_ids) leaves that token out of its text, as
            # vLLM does (it shows when special tokens are kept, e.g. for tool parsers). A grammar that completes on
            # an ordinary token (llguidance ends `}}` without EOS) keeps it.
            stop_tok = len(eco.new_token_ids) - 1 if eco.finish_reason == "stop" and eco.new_token_ids and \
                not state.params.include_stop_str_in_output and state.is_stop_token(eco.new_token_ids[-1]) else -1
            for i, tok in enumerate(eco.new_token_ids):
                state.token_ids.append(tok)
                if state.detok is not None and i != stop_tok:
                    piece = state.detok.step(tok)
                    state.text += piece
                    new_len += len(piece)
            if eco.new_logprobs is not None and state.logprobs is not None:
                dicts = self._to_dicts(eco.new_logprobs)
                state.logprobs.extend(dicts)
                state.cumulative_logprob += sum(lp[0] for lp in eco.new_logprobs.logprobs)
            if eco.finish_reason is not None:
                state.finish_reason, state.stop_reason = eco.finish_reason, eco.stop_reason
            elif state.detok is not None and state._check_stop_strings(new_len):
                to_abort.append(eco.request_id)
            out = self._make_output(state)
            if state.finish_reason is not None:
                state.metrics.finished_time = now
                del self.states[eco.request_id]
            if out is not None:
                if state.queue is not None:
                    state.queue.put_nowait(out)
                else:
                    results.append(out)
        return results, to_abort

    @staticmethod
    def _pooling_output(state: RequestState, eco: EngineCoreOutput, now: float) -> PoolingRequestOutput:
        """The finished output of a pooling request (its vector as a float32 tensor)."""
        if eco.events:
            state.update_from_events(eco.events)
        state.finish_reason = eco.finish_reason
        state.metrics.finished_time = now
        return PoolingRequestOutput(state.request_id, PoolingOutput.from_bytes(eco.pooling_output),
                                    state.prompt_token_ids, True, state.metrics)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finish_reason is not None
        parent = state.parent
        if parent is None:
            if kind == RequestOutputKind.FINAL_ONLY and not finished:
                return None
            return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, state.prompt_logprobs,
                                 [state.completion(kind)], finished, state.metrics, state.num_cached_tokens)
        outs = parent.add_output(state.completion(kind), finished, kind)
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)
        if outs is None:
            return None
        return RequestOutput(parent.request_id, state.prompt, state.prompt_token_ids, state.prompt_logprobs,
                             outs, parent.finished, state.metrics, state.num_cached_tokens)
