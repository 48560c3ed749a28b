"""LLMEngine: the synchronous, in-process engine (processor -> engine core -> output processor)."""

from __future__ import annotations

import itertools
from typing import Any

from pagemill.config import EngineArgs, EngineConfig
from pagemill.engine.core import EngineCore
from pagemill.messages import EngineCoreRequest
from pagemill.engine.output_processor import OutputProcessor, ParentRequest
from pagemill.engine.processor import Processor, PromptType
from pagemill.loader.tokenizer import load_tokenizer
from pagemill.outputs import RequestOutput
from pagemill.sampling_params import SamplingParams


class LLMEngine:
    """Adds requests and steps the engine; each step returns the outputs it completed."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = load_tokenizer(mc.tokenizer, mc.gguf_file, mc.hf_config)
        self.processor = Processor(mc, self.tokenizer)
        self.engine_core = EngineCore(config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._parents: dict[str, ParentRequest] = {}
        self.last_stats = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Build from user-facing arguments."""
        return cls(args.create_engine_config())

    def get_tokenizer(self) -> Any:
        """The tokenizer in use."""
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    queue: Any = None) -> None:
        """Validate and queue a request; n > 1 fans out into child sequences sharing the prompt."""
        text, req = self.processor.process(request_id, prompt, params, arrival_time, priority, cache_salt)
        self.add_processed_request(text, req, queue)

    def add_processed_request(self, text: str | None, req: EngineCoreRequest, queue: Any = None) -> None:
        """Queue a request the processor already validated (see `Processor.process`)."""
        request_id = req.request_id
        parent = self.make_parent(request_id, req.sampling_params)
        if parent is not None:
            self._parents[request_id] = parent
        for child_id, index, child_req in self.fan_out(req):
            self.output_processor.add_request(child_id, text, req.prompt_token_ids, child_req.sampling_params,
                                              parent, index, queue, req.arrival_time)
            self.engine_core.add_request(child_req)

    @staticmethod
    def make_parent(request_id: str, params: SamplingParams) -> ParentRequest | None:
        """The aggregation state of a request with several sequences (n > 1 or best_of > n), else None."""
        num_seqs = max(params.n, params.best_of or 0)
        if num_seqs == 1:
            return None
        return ParentRequest(request_id, num_seqs, num_return=params.n, keep_logprobs=params.logprobs is not None)

    @staticmethod
    def fan_out(req):
        """(child id, index, child request) for each sequence of a request (n, or best_of when larger)."""
        sp = req.sampling_params
        num_seqs = max(sp.n, sp.best_of or 0)
        if num_seqs == 1:
            yield req.request_id, 0, req
            return
        import msgspec

        first = f"0_{req.request_id}"
        # best_of ranks sequences by cumulative logprob, so the children must compute it.
        logprobs = sp.logprobs if num_seqs == sp.n or sp.logprobs is not None else 0
        for i in range(num_seqs):
            child_sp = sp.clone(n=1, best_of=None, logprobs=logprobs,
                                seed=None if sp.seed is None else sp.seed + i)
            # Siblings wait for the first sequence's prefill and then share its prompt blocks.
            yield f"{i}_{req.request_id}", i, msgspec.structs.replace(
                req, request_id=f"{i}_{req.request_id}", sampling_params=child_sp, fork_of=first if i else None)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (and all their child sequences)."""
        ids = [sid for sid, s in self.output_processor.states.items()
               if sid in request_ids or (s.parent is not None and s.parent.request_id in request_ids)]
        self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        """True while anything is in flight."""
        return self.engine_core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the request outputs it produced."""
        core_out = self.engine_core.step()
        self.last_stats = core_out.scheduler_stats
        with self.engine_core.profiler.section("output"):
            outputs, to_abort = self.output_processor.process_outputs(core_out.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        if self._parents:
            for o in outputs:
                if o.finished:
                    self._parents.pop(o.request_id, None)
        return outputs

    def next_request_id(self) -> str:
        """A fresh request id."""
        return str(next(self._ids))
