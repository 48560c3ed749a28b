"""StructuredOutputManager: compiles grammars off the critical path and fills each step's token bitmask.

Grammars compile in a thread pool, cached by (backend, spec) for the engine's one tokenizer; a request waits
(RequestStatus.WAITING_FOR_FSM) until its matcher exists, without holding up the batch. Each step, the bitmask
rows of the constrained requests that sample are filled in another thread while the model runs forward (the
libraries and torch release the GIL); the model runner joins it just before sampling.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from pagemill.config import EngineConfig
from pagemill.core.sched_output import SchedulerOutput
from pagemill.reasoning import ReasoningGate, ReasoningTokens
from pagemill.reasoning.abs_reasoning_parsers import reasoning_parser_class
from pagemill.request import Request
from pagemill.structured_output.request import StructuredOutputRequest
from pagemill.structured_output.spec import GrammarSpec, prepare

_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


class GrammarStep:
    """One step's token bitmask: row i, for request req_ids[i] after its first offsets[i] draft tokens (speculative
    decoding; 0 without), filled in the background; `bitmask()` waits for it."""

    def __init__(self, req_ids: list[str], offsets: list[int], future: Future) -> None:
        self.req_ids = req_ids
        self.offsets = offsets
        self._future = future
        self.fill_seconds = 0.0

    def bitmask(self) -> torch.Tensor:
        """[len(req_ids), ceil(vocab / 32)] int32, bit t of a row set where token t is allowed."""
        bitmask, self.fill_seconds = self._future.result()
        return bitmask


class StructuredOutputManager:
    """Owns the backends (created on first use), the compiled-grammar cache and the bitmask buffer."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        self.config = config.structured_outputs_config
        self._model_config = config.model_config
        self.vocab_size = config.model_config.hf_config.vocab_size
        self._tokenizer = tokenizer
        self._backends: dict[str, Any] = {}
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, GrammarSpec], Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._compile_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagemill-grammar")
        self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagemill-bitmask")
        self._pending: set[Future] = set()
        self._bitmask: torch.Tensor | None = None  # [max_num_seqs, words], allocated on first use
        spec = config.speculative_config
        # one row per constrained request, or one per position it verifies (its drafts and the token after them)
        self._max_rows = config.scheduler_config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        self.num_live = 0  # requests holding a matcher (no per-step work while 0)
        self._reasoning_tokens: ReasoningTokens | None = None  # the reasoning markers' ids (built on first use)
        self._done_none: Future = Future()
        self._done_none.set_result(None)

    # ---- reasoning ----
    def reasoning_tokens(self) -> ReasoningTokens | None:
        """The token ids of the reasoning parser's start / end markers (None without a token-level parser)."""
        c = self.config
        if c.reasoning_parser is None:
            return None
        if self._reasoning_tokens is None:
            cls = reasoning_parser_class(c.reasoning_parser)
            start, end = c.reasoning_start_str or cls.start_token, c.reasoning_end_str or cls.end_token
            if start is None or end is None:
                return None
            self._reasoning_tokens = ReasoningTokens.from_strings(self._tokenizer_now(), start, end)
        return self._reasoning_tokens

    def _gate(self, req: Request) -> ReasoningGate | None:
        budget = req.sampling_params.thinking_token_budget
        if self.config.enable_in_reasoning and req.sampling_params.structured_outputs is not None:
            if budget is not None:  # the grammar owns every token: no end marker can be forced into it
                raise ValueError("thinking_token_budget cannot be combined with structured output on a server "
                                 "started with structured_outputs_config.enable_in_reasoning.")
            return None  # enable_in_reasoning: the grammar applies from the first token, thinking included
        tokens = self.reasoning_tokens()
        if tokens is None:
            if budget is not None:
                raise ValueError("thinking_token_budget needs a server started with a --reasoning-parser whose "
                                 "reasoning ends with a marker (e.g. deepseek_r1, qwen3).")
            return None
        return ReasoningGate(tokens, budget, req.prompt_token_ids)

    # ---- admission ----
    def add_request(self, req: Request) -> None:
        """Validate the request's constraint (ValueError naming the field) and start compiling its matcher."""
        params = req.sampling_params.structured_outputs
        if params is None and req.sampling_params.thinking_token_budget is None:
            return
        gate = self._gate(req)
        if params is None:
            req.structured_output = StructuredOutputRequest(req.request_id, None, "", self._done_none, self._release,
                                                            gate)
            self.num_live += 1
            return
        spec, backend = prepare(params, self.config)
        future = self._compile_pool.submit(self._new_grammar, backend, spec)
        self._pending.add(future)
        req.structured_output = StructuredOutputRequest(req.request_id, spec, backend, future, self._release, gate)
        self.num_live += 1

    def _release(self) -> None:
        self.num_live -= 1

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to `timeout` s until some pending compile finishes (when only grammar-waiting requests remain)."""
        self._pending = {f for f in self._pending if not f.done()}
        if self._pending:
            wait(self._pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- compilation (pool threads) ----
    def _tokenizer_now(self) -> Any:
        if self._tokenizer is None:  # a separate engine-core process: load our own copy once
            from pagemill.loader.tokenizer import load_tokenizer

            mc = self._model_config
            self._tokenizer = load_tokenizer(mc.tokenizer, mc.gguf_file, mc.hf_config)
        return self._tokenizer

    def backend(self, name: str) -> Any:
        """The backend object for `name` (built once: tokenizer info over the model's vocabulary)."""
        with self._backend_lock:
            if name not in self._backends:
                tokenizer = self._tokenizer_now()
                if name == "xgrammar":
                    from pagemill.structured_output.backend_xgrammar import XgrammarBackend as cls
                else:
                    from pagemill.structured_output.backend_guidance import GuidanceBackend as cls
                self._backends[name] = cls(tokenizer, self.vocab_size, tokenizer.eos_token_id)
            return self._backends[name]

    def compiled(self, backend: str, spec: GrammarSpec) -> Any:
        """The compiled grammar of a spec: compiled once, cached; concurrent requests for it wait for one compile."""
        key = (backend, spec)
        with self._cache_lock:
            future = self._cache.get(key)
            owner = future is None
            if owner:
                future = self._cache[key] = Future()
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                future.set_result(self.backend(backend).compile(spec))
            except Exception as e:
                future.set_exception(e if isinstance(e, ValueError) else spec.error(e))
                with self._cache_lock:
                    self._cache.pop(key, None)
        return future.result()

    def _new_grammar(self, backend: str, spec: GrammarSpec) -> Any:
        return self.backend(backend).new_grammar(self.compiled(backend, spec))

    # ---- per step ----
    def start_bitmask(self, so: SchedulerOutput, requests: Mapping[str, Request]) -> GrammarStep | None:
        """Start filling the bitmask rows of this step's constrained requests that sample; None if there are none."""
        if not self.num_live:
            return None
        req_ids, grammars, drafts, forced = [], [], [], []
        for rid in so.num_scheduled_tokens:
            req = requests[rid]
            sor = req.structured_output
            if sor is not None and req.num_computed_tokens >= req.num_tokens:
                req_ids.append(rid)
                # thinking: no grammar yet, but maybe a forced end-marker token (a spent thinking budget)
                grammars.append(sor.grammar if sor.constrains else None)
                forced.append(sor.forced_token())
                drafts.append(so.scheduled_spec_decode_tokens.get(rid, ()))
        if not req_ids:
            return None
        rows = [(rid, j) for rid, d in zip(req_ids, drafts) for j in range(len(d) + 1)]
        return GrammarStep([r for r, _ in rows], [j for _, j in rows],
                           self._fill_pool.submit(self._fill, grammars, drafts, forced))

    def _fill(self, grammars: list[Any], drafts: list[Sequence[int]],
              forced: list[int | None] | None = None) -> tuple[torch.Tensor, float]:
        """Rows in GrammarStep order: each request's current state, then (with drafts, which the scheduler checked
        against the grammar) its state after each draft token; the matchers end where they started. A request
        still thinking (grammar None) allows every token, or only its forced token."""
        start = time.perf_counter()
        if self._bitmask is None:
            self._bitmask = torch.full((self._max_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        first_rows = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        bitmask = self._bitmask[:first_rows[-1]]
        groups: dict[str, tuple[list[Any], list[int]]] = {}
        for i, (row, g, d) in enumerate(zip(first_rows, grammars, drafts)):
            if g is None:
                bitmask[row:row + len(d) + 1] = -1
                token = forced[i] if forced else None
                if token is not None:
                    bitmask[row] = 0
                    bit = token % 32
                    bitmask[row, token // 32] = (1 << bit) if bit < 31 else -(1 << 31)
                continue
            gs, rows = groups.setdefault(g.backend, ([], []))
            gs.append(g)
            rows.append(row)
        for name, (gs, rows) in groups.items():  # one batched call for the current states
            self._backends[name].fill_bitmask(gs, bitmask, rows)
        for row, g, d in zip(first_rows, grammars, drafts):  # then the states after drafts, request by request
            if g is None:
                continue
            accepted = 0
            for j, token in enumerate(d, 1):
                if not g.accept_token(token):  # (the scheduler checked the drafts: not expected)
                    bitmask[row + j:row + len(d) + 1] = -1
                    break
                accepted += 1
                if g.is_terminated():  # a draft ended the grammar: the rows after it go unused
                    bitmask[row + j:row + len(d) + 1] = -1
                    break
                self._backends[g.backend].fill_bitmask([g], bitmask, [row + j])
            if accepted:
                g.rollback(accepted)
        return bitmask, time.perf_counter() - start

    def shutdown(self) -> None:
        """Stop the worker threads."""
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
