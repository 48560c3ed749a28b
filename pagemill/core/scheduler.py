"""vLLM v1-style scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill or decode phases: each step gives tokens to requests so that their
num_computed_tokens catches up with num_tokens (chunked prefill, prefix hits and recompute
after preemption all follow from that).
"""

from __future__ import annotations

import heapq
import sys
import time
from collections import deque

import msgspec

from pagemill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagemill.core.draft_policy import DraftPolicy
from pagemill.core.kv_cache_manager import KVCacheManager, SwapLayout, cdiv
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.kv_connector import SchedulerConnector
from pagemill.core.sched_output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                        SchedulerOutput)
from pagemill.core.sched_policy import SRTF_POLICIES, make_policy_queue
from pagemill.core.swap_space import SwapSpace
from pagemill.messages import EngineCoreEventType, EngineCoreOutput, LogprobsLists
from pagemill.metrics.stats import SchedulerStats, SpecDecodingStats
from pagemill.request import Request, RequestStatus


class _WaitingQueue:
    """FCFS deque or a priority heap (lower priority value first, then arrival)."""

    def __init__(self, policy: str) -> None:
        self.priority = policy == "priority"
        self._items: deque[Request] | list[Request] = [] if self.priority else deque()

    def add(self, req: Request) -> None:
        if self.priority:
            heapq.heappush(self._items, req)
        else:
            self._items.append(req)

    def add_front(self, req: Request) -> None:
        """Re-queue a preempted request ahead of new arrivals (FCFS) or by its priority."""
        if self.priority:
            heapq.heappush(self._items, req)
        else:
            self._items.appendleft(req)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return heapq.heappop(self._items) if self.priority else self._items.popleft()

    def remove(self, req: Request) -> None:
        self._items.remove(req)
        if self.priority:
            heapq.heapify(self._items)

    def admitted(self, req: Request) -> None:
        """FCFS and priority keep no count of admissions."""

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


class Scheduler:
    """Decides each step's batch and applies the model's results to the requests."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_config: KVCacheConfig, speculative_config: SpeculativeConfig | None = None,
                 max_loras: int = 0, kv_connector: SchedulerConnector | None = None,
                 draft_policy: DraftPolicy | None = None) -> None:
        self.config = scheduler_config
        # The scheduler side of a KV connector: prompt blocks found outside count as computed (disaggregated
        # prefill, KV offload) and are loaded by the worker before the step's forward.
        self.connector = kv_connector
        self.external_prefix_cache_queries = 0  # tokens looked up in the connector (counter)
        self.external_prefix_cache_hits = 0  # tokens loaded through it instead of computed (counter)
        # Async scheduling: a step is planned before the previous step's tokens are known (output placeholders).
        self.async_scheduling = scheduler_config.async_scheduling
        self.max_loras = max_loras  # adapters one step may mix (the runner's LoRA slots; 0: LoRA disabled)
        self._reset_preempted: set[str] = set()  # preempted outside schedule() (reset_prefix_cache): for the runner
        self.spec_config = speculative_config
        # Speculative decoding: which steps and requests get drafts (spec_decode/backoff.py's back-off).
        if speculative_config is not None and draft_policy is None:
            raise ValueError("speculative_config needs a draft_policy (pagemill.spec_decode.backoff."
                             "SpeculativeBackoff) to decide which requests get drafts.")
        self.draft_policy = draft_policy
        # A draft model writes its own KV for the tokens it proposes: their slots are allocated ahead (lookahead).
        self.num_lookahead_tokens = (speculative_config.num_speculative_tokens
                                     if speculative_config is not None and speculative_config.method == "draft_model"
                                     else 0)
        # kv_cache_layout="virtual" maps a request's next chunk during the step before it is written (one chunk
        # ahead, off the critical path): the block of one more token is allocated a step early, from the same pool.
        # (A scheduled request has at most max_model_len - 1 tokens, so this stays within max_model_len.)
        self.num_lookahead_tokens += cache_config.kv_cache_layout == "virtual"
        self.spec_stats = SpecDecodingStats(speculative_config.num_speculative_tokens, 0, 0, 0,
                                            [0] * speculative_config.num_speculative_tokens) \
            if speculative_config is not None else None
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.kv_cache_manager = KVCacheManager(kv_cache_config.num_blocks, kv_cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               cache_config.prefix_caching_hash_algo, kv_cache_config.group_windows)
        self.requests: dict[str, Request] = {}
        self.waiting = (make_policy_queue(scheduler_config, self.kv_cache_manager)
                        if scheduler_config.policy in SRTF_POLICIES else _WaitingQueue(scheduler_config.policy))
        self.running: list[Request] = []
        # Requests of batches whose output is not back yet; with a batch queue (pipeline micro-batches) they are not
        # scheduled again, nor preempted, until it is. `max_concurrent_batches` such batches share the requests.
        self.in_flight: set[str] = set()
        self.max_concurrent_batches = 1
        self.pending_forks: dict[str, list[Request]] = {}  # parent id -> siblings waiting for its prefill
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_swapped_out = 0  # preemptions by swapping (counter)
        self.swap_space = SwapSpace(kv_cache_config.num_swap_blocks)
        self._swap_out: list[tuple[int, int]] = []
        self._swap_layouts: dict[str, SwapLayout] = {}  # swapped-out request -> its block tables' shape
        self.num_prompt_tokens = 0  # computed prompt tokens (counter)
        self.num_generation_tokens = 0
        self._failed_outputs: list[EngineCoreOutput] = []  # requests whose grammar failed to compile
        self._cut_tables: dict[str, int] = {}  # request -> table length after freeing rejected drafts' blocks
        # Async scheduling: finished requests' tokens still in flight (their id may be reused meanwhile): how many.
        self._stale_tokens: dict[str, int] = {}

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        """Queue a new request (WAITING_FOR_FSM while its structured-output grammar compiles)."""
        self.requests[request.request_id] = request
        if self.draft_policy is not None:
            self.draft_policy.add_request(request)
        if request.structured_output is not None and not request.structured_output.is_ready():
            request.status = RequestStatus.WAITING_FOR_FSM
        parent = self.requests.get(request.fork_of) if request.fork_of else None
        if parent is not None and parent.num_output_tokens == 0:
            self.pending_forks.setdefault(parent.request_id, []).append(request)
        else:
            self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (usually abort) requests wherever they are; returns the ones that existed."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.fork_of in self.pending_forks and req in self.pending_forks[req.fork_of]:
                self.pending_forks[req.fork_of].remove(req)
            else:
                self._detach(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _detach(self, req: Request) -> None:
        """Take an unfinished request out of the running list or the waiting queue (its swap blocks freed)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            return
        self.waiting.remove(req)
        if req.swapped_blocks is not None:
            self.swap_space.free(req.swapped_blocks)
            req.swapped_blocks = None
            del self._swap_layouts[req.request_id]

    def _free(self, req: Request) -> None:
        if req.num_output_placeholders:
            self._stale_tokens[req.request_id] = req.num_output_placeholders
        self._cut_tables.pop(req.request_id, None)
        if self.connector is not None:  # (its saves are synchronous: the blocks can go back at once)
            self.connector.request_finished(req, self.kv_cache_manager.get_block_ids(req.request_id)[0])
        if req.structured_output is not None:
            req.structured_output.free()
        self.kv_cache_manager.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        """True while anything is running or waiting."""
        return bool(self.running) or len(self.waiting) > 0

    # ---- one step ----
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block hash. Blocks in use keep it from happening, unless `reset_running_requests`
        preempts the running requests first (the runner learns of it in the next step's output; requests of a batch
        in flight keep their blocks, so the reset fails while there are any)."""
        if reset_running_requests:
            for req in [r for r in reversed(self.running) if r.request_id not in self.in_flight]:
                self.running.remove(req)
                self._preempt(req)
                self._reset_preempted.add(req.request_id)
        return self.kv_cache_manager.reset_prefix_cache()

    def _preempt_victim(self) -> Request:
        """A running request to preempt; never one in flight (the request being scheduled is not)."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight] if self.in_flight \
            else self.running
        if self.config.policy == "priority":
            victim = max(candidates, key=lambda r: (r.priority, r.arrival_time))
        elif self.config.policy in SRTF_POLICIES:  # the running request the policy would serve last
            victim = self.waiting.victim(candidates)
        else:
            victim = candidates[-1]  # fcfs: the latest arrival
        self.running.remove(victim)
        return victim

    def _encoder_inputs(self, req: Request, start: int, num_new: int, encoder_budget: int,
                        encoder_full: int) -> tuple[int, int, int]:
        """(tokens to schedule, encoder tokens they start, images scheduled so far after them) for a chunk of
        `num_new` tokens of `req` from `start`: the chunk stops before an image whose encoder run the step's
        encoder budget has no room for (an image over the whole budget still runs first in a step), and, with
        disable_chunked_mm_input, before an image whose placeholder run it would split (none if it starts inside
        one it cannot finish: it waits for a step with room)."""
        cost, images = 0, req.num_images_scheduled
        whole = self.config.disable_chunked_mm_input
        for j in range(req.num_images_scheduled, len(req.mm_features)):
            f = req.mm_features[j]
            if f.offset >= start + num_new:
                break
            if whole and start < f.offset + f.length and f.offset + f.length > start + num_new:
                return max(0, f.offset - start), cost, images
            if f.offset + f.length > start:  # (an image before `start` was a prefix-cache hit: never encoded)
                if cost + f.length > encoder_budget and not (cost == 0 and encoder_budget == encoder_full):
                    return max(0, f.offset - start), cost, images
                cost += f.length
            images = j + 1
        return num_new, cost, images

    def schedule(self) -> SchedulerOutput:
        """Plan one step within the token budget, preempting by recompute when blocks run out."""
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        max_reqs = self._batch_share()
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        swap_in: list[tuple[int, int]] = []
        spec_tokens: dict[str, list[int]] = {}
        if self.config.policy in SRTF_POLICIES:
            self.waiting.order_running(self.running, budget)
        encoder_full = self.config.max_num_encoder_input_tokens or budget
        encoder_budget = encoder_full

        # (the loop runs once per running request every step: the lookups it repeats are hoisted)
        kv_manager = self.kv_cache_manager
        allocate_slots = kv_manager.allocate_slots
        replaced_blocks, cut_tables = kv_manager.replaced_blocks, self._cut_tables
        in_flight, running = self.in_flight, self.running
        srtf = self.config.policy in SRTF_POLICIES
        lookahead = self.num_lookahead_tokens
        i = 0
        while i < len(running) and budget > 0 and len(num_scheduled) < max_reqs:
            req = running[i]
            if in_flight and req.request_id in in_flight:  # its batch's output is not back
                i += 1
                continue
            if req.num_output_placeholders and self._ends_in_flight(req):
                i += 1  # its last token is being sampled: no wasted step after it (vLLM does the same)
                continue
            num_computed = req.num_computed_tokens
            num_new = min(req.num_tokens_with_spec + req.num_output_placeholders - num_computed, budget,
                          max_len - num_computed)
            if (srtf and req.num_tokens - num_computed > 1 and not preempted
                    and len(running) < self.config.max_num_seqs):  # a prefill chunk: srtf may put waiting first
                num_new = min(num_new, budget - self.waiting.budget_to_yield(req, budget))
            if req.mm_features:
                num_new, encoder_cost, images = self._encoder_inputs(req, req.num_computed_tokens, num_new,
                                                                      encoder_budget, encoder_full)
            if num_new <= 0:
                i += 1
                continue
            while True:
                new_blocks = allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
                if new_blocks is not None:
                    break
                victim = self._preempt_victim()
                if victim.request_id in num_scheduled:  # already planned this step: take it back
                    budget += num_scheduled.pop(victim.request_id)
                    spec_tokens.pop(victim.request_id, None)
                    cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                if victim is not req and i > 0 and self.running[i - 1] is req:
                    i -= 1  # the victim stood before req (a policy may pick any running request)
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if new_blocks is None:
                break  # req itself was preempted; everything after it is gone too
            num_scheduled[req.request_id] = num_new
            if req.mm_features:
                encoder_budget -= encoder_cost
                req.num_images_scheduled = images
            if req.spec_token_ids:  # the budget or the context length may leave room for fewer drafts
                num_spec = num_new + req.num_computed_tokens - req.num_tokens
                if num_spec > 0:
                    del req.spec_token_ids[num_spec:]
                    spec_tokens[req.request_id] = req.spec_token_ids
                else:
                    req.spec_token_ids = []
            cached = CachedRequestData(req.request_id, [[b.block_id for b in g] for g in new_blocks],
                                       req.num_computed_tokens)
            if replaced_blocks:
                cached.replaced_block_ids = replaced_blocks.pop(req.request_id, None) or None
            if cut_tables:
                cached.num_blocks_kept = cut_tables.pop(req.request_id, None)
            cached_reqs.append(cached)
            budget -= num_new
            i += 1

        now = time.monotonic()
        skipped: list[Request] = []  # waiting for their grammar or an adapter slot: they keep their place
        loras = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()
        while (not preempted and len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(num_scheduled) < max_reqs):
            req = self.waiting.peek()
            if req.num_output_placeholders:  # preempted with a step in flight: resumes once its token is known
                skipped.append(self.waiting.pop())
                continue
            if req.lora_int_id and req.lora_int_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.pop())  # every slot is taken by running requests' adapters
                continue
            if req.status == RequestStatus.WAITING_FOR_FSM:
                if not req.structured_output.is_ready():
                    skipped.append(self.waiting.pop())
                    continue
                if req.structured_output.error is not None:
                    self._fail_grammar(self.waiting.pop())
                    continue
                req.status = RequestStatus.WAITING
            hit_blocks, num_hit, num_external = None, 0, 0
            if req.swapped_blocks is not None:
                if not self._swap_in(req, min(req.num_tokens - req.num_computed_tokens, budget), swap_in):
                    break
            elif req.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
                if self.connector is not None:
                    num_external, _ = self.connector.get_num_new_matched_tokens(req, num_hit)
            num_new = min(req.num_tokens - req.num_computed_tokens - num_hit - num_external, budget)
            if req.mm_features:
                num_new, encoder_cost, images = self._encoder_inputs(
                    req, req.num_computed_tokens + num_hit + num_external, num_new, encoder_budget, encoder_full)
                if num_new <= 0:
                    break
            if not self.kv_cache_config.has_kv_cache and num_new < req.num_tokens:
                break  # an encoder-only model has no KV cache to resume from: the whole prompt waits for room
            # (externally computed tokens take blocks but no budget: they are loaded, not computed)
            new_blocks = self.kv_cache_manager.allocate_slots(req, num_new + num_external, num_hit, hit_blocks,
                                                              num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is None:
                break
            self.waiting.pop()
            self.waiting.admitted(req)
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self.kv_cache_manager.get_block_ids(req.request_id)[0],
                                                        num_external)
                if req.num_computed_tokens == 0:
                    self.external_prefix_cache_queries += req.num_tokens - num_hit
                    self.external_prefix_cache_hits += num_external
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit + num_external
            req.record_event(EngineCoreEventType.SCHEDULED, now)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens += num_hit + num_external
            self.running.append(req)
            num_scheduled[req.request_id] = num_new
            if req.mm_features:
                encoder_budget -= encoder_cost
                req.num_images_scheduled = images
            new_reqs.append(NewRequestData(req.request_id, list(req.all_token_ids), req.num_prompt_tokens,
                                           req.sampling_params,
                                           self.kv_cache_manager.get_block_ids(req.request_id),
                                           req.num_computed_tokens,
                                           req.eos_token_id, req.lora_request))
            if req.lora_int_id:
                loras.add(req.lora_int_id)
            if req.pooling_params is not None:
                new_reqs[-1].pooling_params, new_reqs[-1].token_type_ids = req.pooling_params, req.token_type_ids
            new_reqs[-1].mm_features = req.mm_features
            budget -= num_new
        for req in reversed(skipped):
            self.waiting.add_front(req)

        total = sum(num_scheduled.values())
        to_propose: dict[str, int] = {}
        speculate = self.draft_policy is not None and self.draft_policy.speculate_this_step(len(self.running))
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            prompt_left = max(0, req.num_prompt_tokens - req.num_computed_tokens)
            self.num_prompt_tokens += min(n, prompt_left)
            req.num_computed_tokens += n
            if (self.async_scheduling and req.pooling_params is None
                    and req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders):
                req.num_output_placeholders += 1  # it samples this step: the token is known when the step ends
            if speculate and req.num_computed_tokens >= req.num_tokens:  # it samples this step
                k = self._num_drafts_wanted(req)
                if k:
                    to_propose[rid] = k
        copies, _ = self.kv_cache_manager.take_step_changes()
        out = SchedulerOutput(new_reqs, cached_reqs, num_scheduled, total,
                              finished_req_ids=self.finished_req_ids,
                              preempted_req_ids=preempted | self._take_reset_preempted(),
                              blocks_to_copy=copies, blocks_to_swap_out=self._swap_out, blocks_to_swap_in=swap_in,
                              scheduled_spec_decode_tokens=spec_tokens, num_spec_tokens_to_propose=to_propose)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self.finished_req_ids = set()
        self._swap_out = []
        if self.max_concurrent_batches > 1:  # (one batch at a time: its output is back before the next schedule)
            self.in_flight.update(num_scheduled)
        return out

    def _batch_share(self) -> int:
        """The most requests one batch takes: all, or with several batches in flight (pipeline micro-batches)
        an even share of the requests that could run, so that every stage has work."""
        if self.max_concurrent_batches == 1:
            return sys.maxsize
        runnable = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-runnable // self.max_concurrent_batches))

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether the tokens of the steps in flight bring the request to max_tokens or the context length."""
        num_tokens = req.num_tokens + req.num_output_placeholders
        return num_tokens >= self.config.max_model_len or (
            req.max_tokens is not None and num_tokens - req.num_prompt_tokens >= req.max_tokens)

    def _num_drafts_wanted(self, req: Request) -> int:
        """Draft tokens to propose for the request's next step: none when it opted out, else the policy's."""
        if not req.sampling_params.speculative_decoding:
            return 0
        return self.draft_policy.num_drafts(req)

    def _constrained_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """A constrained request's drafts: the proposer's, cut where its grammar would reject them, or the tokens
        the grammar forces next if those are more (jump-forward: a forced token is always accepted, its masked
        probability being 1)."""
        grammar = req.structured_output.grammar
        if drafts:
            del drafts[grammar.validate_tokens(drafts):]
        if not req.sampling_params.speculative_decoding:
            return drafts
        room = min(self.spec_config.num_speculative_tokens, self.config.max_model_len - req.num_tokens - 1)
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - req.num_output_tokens - 1)
        if room <= len(drafts):
            return drafts
        forced = grammar.forced_tokens(room)
        return forced if len(forced) > len(drafts) else drafts

    def _verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Account one verification: counters, the rollback of rejected slots, and the draft policy's averages."""
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.num_accepted_tokens_per_pos
        for j in range(min(num_accepted, len(per_pos))):
            per_pos[j] += 1
        num_rejected = num_drafts - num_accepted
        if num_rejected:
            req.num_computed_tokens -= num_rejected
            kept = self.kv_cache_manager.free_tail(req, req.num_computed_tokens)
            if kept is not None:  # the runner's copy of the tables must be cut too
                self._cut_tables[req.request_id] = kept
        self.draft_policy.verified(req, num_drafts, num_accepted)

    def _fail_grammar(self, req: Request) -> None:
        """A grammar that passed validation but failed to compile: the request ends (reported as an abort)."""
        error = req.structured_output.error
        req.status = RequestStatus.FINISHED_ABORTED
        self._free(req)
        self._failed_outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="abort",
                                                     stop_reason=f"structured output compile error: {error}"))

    def _fork(self, parent: Request, children: list[Request]) -> None:
        """Parallel sampling: siblings share the parent's prompt blocks and recompute only the last prompt token."""
        if parent.status != RequestStatus.RUNNING:  # (async scheduling) preempted while its prefill ran: no blocks
            for child in children:
                self.waiting.add(child)
            return
        for child in children:
            self.kv_cache_manager.fork(parent, child, parent.num_prompt_tokens)
            child.num_computed_tokens = parent.num_prompt_tokens - 1
            child.num_cached_tokens = 0
            self.waiting.add_front(child)

    def _take_reset_preempted(self) -> set[str]:
        taken, self._reset_preempted = self._reset_preempted, set()
        return taken

    def _preempt(self, req: Request) -> None:
        """Preempt by swapping the request's blocks out (if configured and there is room) or by recompute."""
        req.status = RequestStatus.PREEMPTED
        req.record_event(EngineCoreEventType.PREEMPTED)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.spec_token_ids = []
        self._cut_tables.pop(req.request_id, None)
        swap_ids = None
        if self.config.preemption_mode == "swap":
            block_ids, layout = self.kv_cache_manager.swap_layout(req.request_id)
            swap_ids = self.swap_space.allocate(len(block_ids))
        if swap_ids is not None:
            self._swap_out.extend(zip(block_ids, swap_ids))
            req.swapped_blocks = swap_ids
            self._swap_layouts[req.request_id] = layout
            self.num_swapped_out += 1
        else:
            req.num_computed_tokens = 0
        self.kv_cache_manager.free(req)
        self.waiting.add_front(req)

    def _swap_in(self, req: Request, num_new: int, swap_in: list[tuple[int, int]]) -> bool:
        """Bring a swapped-out request back into fresh KV blocks, if the pool has room for it and its new tokens."""
        length, _ = layout = self._swap_layouts[req.request_id]
        grow = max(cdiv(req.num_computed_tokens + num_new, self.block_size) - length, 0)
        needed = len(req.swapped_blocks) + grow * len(layout[1])
        if needed > self.kv_cache_manager.block_pool.get_num_free_blocks():
            return False
        del self._swap_layouts[req.request_id]
        blocks = self.kv_cache_manager.allocate_for_swap_in(req, layout)
        swap_in.extend(zip(req.swapped_blocks, (b.block_id for b in blocks)))
        self.swap_space.free(req.swapped_blocks)
        req.swapped_blocks = None
        return True

    @staticmethod
    def _new_prompt_logprobs(req: Request, lp: LogprobsLists, num_scheduled: int) -> LogprobsLists | None:
        """The part of a step's prompt logprobs not sent before (a request preempted by recompute computes its
        prompt, and so its prompt logprobs, again)."""
        start = req.num_computed_tokens - num_scheduled  # the position of the step's first logprob
        n = len(lp.ranks)
        skip = max(0, req.num_prompt_logprobs_sent - start)
        req.num_prompt_logprobs_sent = max(req.num_prompt_logprobs_sent, start + n)
        if skip >= n:
            return None
        return lp.slice(skip) if skip else lp

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, free finished requests; one output per request."""
        outputs, self._failed_outputs = self._failed_outputs, []
        if self.in_flight:
            self.in_flight.difference_update(sched.num_scheduled_tokens)
        if self.draft_policy is not None:
            self.draft_policy.step_done(sched, out)
        # (once per scheduled request every step: lookups hoisted, empty maps skipped)
        stale, requests, sampled = self._stale_tokens, self.requests, out.sampled
        pooler_output, prompt_logprobs, all_logprobs = out.pooler_output, out.prompt_logprobs, out.logprobs
        spec_tokens, pending_forks = sched.scheduled_spec_decode_tokens, self.pending_forks
        num_generated = 0
        for rid in sched.num_scheduled_tokens:
            if stale and rid in stale and rid in sampled:  # a finished request's extra token: discarded
                stale[rid] -= 1
                if not stale[rid]:
                    del stale[rid]
                continue
            req = requests.get(rid)
            if req is None:
                continue
            if pooler_output:
                pooled = pooler_output.get(rid)
                if pooled is not None:
                    outputs.append(self._finish_pooled(req, pooled))
                    continue
            prompt_lp = prompt_logprobs.get(rid) if prompt_logprobs else None
            if prompt_lp is not None:
                prompt_lp = self._new_prompt_logprobs(req, prompt_lp, sched.num_scheduled_tokens[rid])
            tokens = sampled.get(rid)
            if tokens and req.num_output_placeholders:
                req.num_output_placeholders -= 1
            if not tokens:
                if prompt_lp is not None:
                    outputs.append(EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_lp, events=req.take_events()))
                continue
            if spec_tokens:
                drafts = spec_tokens.get(rid)
                if drafts:
                    self._verified(req, len(drafts), len(tokens) - 1)
            status = None
            for n, token in enumerate(tokens, 1):
                req.append_output_token(token)
                if req.structured_output is not None:
                    req.structured_output.accept_token(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            num_generated += n
            logprobs = all_logprobs.get(rid) if all_logprobs else None
            if n < len(tokens):  # stopped inside the accepted drafts: the rest are not outputs
                tokens = tokens[:n]
                if logprobs is not None:
                    logprobs = logprobs.slice(0, n)
            if pending_forks and rid in pending_forks:
                self._fork(req, pending_forks.pop(rid))
            eco = EngineCoreOutput(rid, tokens, new_logprobs=logprobs, new_prompt_logprobs=prompt_lp,
                                   num_cached_tokens=max(req.num_cached_tokens, 0), events=req.take_events())
            if status is None:
                drafts = out.draft_token_ids.get(rid, [])
                sor = req.structured_output
                if sor is not None and self.spec_config is not None:
                    if sor.constrains:
                        drafts = self._constrained_drafts(req, drafts)
                    elif sor.in_reasoning and sor.reasoning.budget is not None:
                        drafts = []  # a spent budget forces the end marker one token a step
                req.spec_token_ids = drafts
            else:
                self._detach(req)  # (async scheduling: it may have been preempted while this step ran)
                req.status = status
                eco.finish_reason = status.finish_reason
                eco.stop_reason = req.stop_reason
                self._free(req)
            outputs.append(eco)
        self.num_generation_tokens += num_generated
        return outputs

    def _finish_pooled(self, req: Request, pooled: bytes) -> EngineCoreOutput:
        """A pooling request whose prompt is computed: it ends now and its blocks go back at once."""
        self._detach(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self._free(req)
        return EngineCoreOutput(req.request_id, [], finish_reason="stop", num_cached_tokens=0,
                                events=req.take_events(), pooling_output=pooled)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.structured_output is not None and req.structured_output.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.all_stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.max_tokens is not None and req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def make_stats(self, include_memory: bool = False) -> SchedulerStats:
        """Counters and gauges for logging and /metrics (the memory accounting, O(requests), on request)."""
        pool = self.kv_cache_manager.block_pool
        memory = self.kv_cache_manager.memory_stats() if include_memory else None
        if memory is not None:
            memory["bytes_saved_by_sharing"] = memory["blocks_saved_by_sharing"] * self.kv_cache_config.block_bytes
        return SchedulerStats(
            memory=memory,
            num_swapped_reqs=self.swap_space.num_blocks and sum(1 for r in self.waiting if r.swapped_blocks),
            num_swapped_out=self.num_swapped_out, num_swap_blocks_total=self.swap_space.num_blocks,
            num_swap_blocks_free=self.swap_space.num_free, num_cow_copies=self.kv_cache_manager.num_cow_copies,
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=pool.get_usage(), num_blocks_total=self.kv_cache_config.usable_blocks,
            num_blocks_free=pool.get_num_free_blocks(),
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits, num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens, num_generation_tokens=self.num_generation_tokens,
            external_prefix_cache_queries=self.external_prefix_cache_queries,
            external_prefix_cache_hits=self.external_prefix_cache_hits,
            spec_decoding=self.spec_stats and msgspec.structs.replace(
                self.spec_stats, num_accepted_tokens_per_pos=list(self.spec_stats.num_accepted_tokens_per_pos)))
