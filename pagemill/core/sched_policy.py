"""Shortest-remaining-token-first scheduling (thesis §4.5.2, Algorithm 2) and two-level scheduling (§4.5.3, Fig. 4.2).

Both are waiting queues with the interface of the scheduler's FCFS/priority queue (add, add_front, peek, pop,
remove, len, iter) plus what the scheduler asks of a policy: `admitted` (an admission happened), `order_running`
(who gets the token budget first when it cannot cover the running set) and `victim` (whom to preempt).

A request's remaining work is the tokens it still has to compute (its prompt, or all of it after a preemption
by recompute) plus the outputs still expected (`SamplingParams.expected_output_tokens`, else max_tokens).

- srtf: the waiting request with the least remaining work goes first. Aging bounds starvation: a request that
  has seen `max_passed_over` admissions since it was first queued is served before every request that has not,
  in FIFO order. Keys are computed when a request is queued (O(log n) per operation, no per-step scan), so
  prefix-cache hits do not enter them.
- two-level: arrivals wait in a FIFO queue; when the staging queue is empty, up to `staging_size` of them move
  into it at once, and SRTF picks among the staged ones, with their prefix-cache hits looked up afresh on every
  pick (Algorithm 2's inner loop, bounded by the staging size). A staged request is served before any request
  that arrives after it is staged, which bounds its wait without aging.

The running set (Algorithm 2 picks from W ∪ R): the scheduler serves running requests before waiting ones, but
under srtf and two-level a running prefill chunk leaves the budget that the first waiting request needs when that
request goes before it in the policy's order (a long prompt being prefilled in chunks does not block short ones:
no head-of-line blocking), and when the budget cannot cover the running set, the requests with the fewest tokens
to compute this step go first (decodes, then the shortest rest of a prefill: Algorithm 2's Δ). The preemption
victim is the running request the policy would serve last.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pagemill.config import SchedulerConfig
from pagemill.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagemill.core.kv_cache_manager import KVCacheManager

SRTF_POLICIES = ("srtf", "two-level")


def expected_output_tokens(req: Request, max_model_len: int) -> int:
    """Outputs the request is expected to produce in all: its hint, capped by max_tokens and the context."""
    cap = max_model_len - req.num_prompt_tokens
    if req.max_tokens is not None:
        cap = min(cap, req.max_tokens)
    hint = req.sampling_params.expected_output_tokens
    return cap if hint is None else min(hint, cap)


def remaining_tokens(req: Request, max_model_len: int) -> int:
    """Tokens still to compute plus outputs still expected: SRTF's key (smaller first)."""
    left = expected_output_tokens(req, max_model_len) - req.num_output_tokens
    return req.num_tokens - req.num_computed_tokens + max(left, 0)


def order_running(running: list[Request], budget: int, max_model_len: int) -> None:
    """Sort the running set by tokens to compute this step (then remaining tokens), only when the budget cannot
    cover them all: otherwise everyone is served and the order does not matter."""
    demand = 0
    for r in running:
        demand += r.num_tokens_with_spec - r.num_computed_tokens
    if demand > budget:
        running.sort(key=lambda r: (r.num_tokens_with_spec - r.num_computed_tokens,
                                    remaining_tokens(r, max_model_len)))


class _PolicyQueue(ABC):
    """What srtf and two-level share: the policy's order (`rank`, smaller first) applied to the running set."""

    def __init__(self, max_model_len: int, kv_cache_manager: KVCacheManager) -> None:
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager

    @abstractmethod
    def __len__(self) -> int:
        """Requests waiting."""

    @abstractmethod
    def peek(self) -> Request:
        """The waiting request the policy serves next."""

    @abstractmethod
    def rank(self, req: Request) -> tuple:
        """The policy's order of a request (smaller first)."""

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt: the one the policy would serve last."""
        return max(running, key=self.rank)

    def order_running(self, running: list[Request], budget: int) -> None:
        """Give the budget first to the running requests with the fewest tokens to compute this step."""
        order_running(running, budget, self.max_model_len)

    def _hit_tokens(self, req: Request) -> int:
        if req.num_computed_tokens or req.swapped_blocks is not None:  # the scheduler looks up hits only then
            return 0
        return self.kv_cache_manager.get_computed_blocks(req, count=False)[1]

    def budget_to_yield(self, req: Request, budget: int) -> int:
        """Budget the running prefill `req` leaves to the next waiting request, if that one goes first: the tokens
        it has to compute when its blocks are free (else nothing), at most budget - 1 so that `req` progresses."""
        if not len(self):
            return 0
        head = self.peek()
        if head.status == RequestStatus.WAITING_FOR_FSM or self.rank(head) >= self.rank(req):
            return 0
        need = head.num_tokens - head.num_computed_tokens - self._hit_tokens(head)
        mgr = self.kv_cache_manager
        if -(-need // mgr.block_size) * len(mgr.groups) > mgr.block_pool.get_num_free_blocks():
            return 0
        return max(min(need, budget - 1), 0)


class SRTFQueue(_PolicyQueue):
    """Waiting requests by remaining tokens, with aging: a request passed over by `max_passed_over` admissions
    goes first, in FIFO order (of first queuing, which a preemption does not reset)."""

    def __init__(self, max_model_len: int, max_passed_over: int, kv_cache_manager: KVCacheManager) -> None:
        super().__init__(max_model_len, kv_cache_manager)
        self.max_passed_over = max_passed_over
        self.num_admitted = 0
        self._num_queued = 0
        self._live: dict[str, tuple[int, Request]] = {}  # request id -> (entry id, request)
        self._entry_ids = itertools.count()
        # Lazy deletion: an entry is live while _live holds its id for its request.
        self._by_remaining: list[tuple[int, int, int, Request]] = []  # (remaining, queue order, entry id, req)
        self._by_arrival: list[tuple[int, int, Request]] = []  # (queue order, entry id, req)

    def add(self, req: Request) -> None:
        """Queue a request (its aging stamp is taken the first time only)."""
        if req.first_queued is None:
            req.first_queued = (self.num_admitted, self._num_queued)
            self._num_queued += 1
        entry = next(self._entry_ids)
        self._live[req.request_id] = (entry, req)
        order = req.first_queued[1]
        heapq.heappush(self._by_remaining, (remaining_tokens(req, self.max_model_len), order, entry, req))
        heapq.heappush(self._by_arrival, (order, entry, req))
        if len(self._by_arrival) > 2 * len(self._live) + 64:
            self._compact()

    add_front = add  # a re-queued request (preempted, skipped, forked) takes the place its key gives it

    def starving(self, req: Request) -> bool:
        """True once the request has seen `max_passed_over` admissions since it was first queued."""
        return req.first_queued is not None and self.num_admitted - req.first_queued[0] >= self.max_passed_over

    def peek(self) -> Request:
        """The next request: the oldest if it is starving, else the one with the least remaining work."""
        oldest = self._top(self._by_arrival)
        return oldest if self.starving(oldest) else self._top(self._by_remaining)

    def pop(self) -> Request:
        """Take the request `peek` returns."""
        req = self.peek()
        del self._live[req.request_id]
        return req

    def admitted(self, req: Request) -> None:
        """An admission: every request still waiting has been passed over once more."""
        self.num_admitted += 1

    def remove(self, req: Request) -> None:
        """Drop a waiting request (an abort)."""
        if self._live.pop(req.request_id, None) is None:
            raise ValueError(f"request {req.request_id!r} is not waiting")

    def rank(self, req: Request) -> tuple[int, int, int]:
        """The policy's order (smaller first): starving requests in FIFO order, then by remaining tokens."""
        order = req.first_queued[1] if req.first_queued is not None else self._num_queued
        if self.starving(req):
            return 0, order, 0
        return 1, remaining_tokens(req, self.max_model_len), order

    def _top(self, heap: list) -> Request:
        live = self._live
        while True:
            *_, entry, req = heap[0]
            if live.get(req.request_id, (None,))[0] == entry:
                return req
            heapq.heappop(heap)

    def _compact(self) -> None:
        live = self._live
        self._by_remaining = [e for e in self._by_remaining if live.get(e[3].request_id, (None,))[0] == e[2]]
        self._by_arrival = [e for e in self._by_arrival if live.get(e[2].request_id, (None,))[0] == e[1]]
        heapq.heapify(self._by_remaining)
        heapq.heapify(self._by_arrival)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (req for _, req in list(self._live.values()))


class TwoLevelQueue(_PolicyQueue):
    """FIFO waiting queue feeding a staging queue of at most `staging_size` requests (refilled only when empty);
    SRTF, with fresh prefix-cache hits, picks among the staged requests."""

    def __init__(self, max_model_len: int, staging_size: int, kv_cache_manager: KVCacheManager) -> None:
        super().__init__(max_model_len, kv_cache_manager)
        self.staging_size = staging_size
        self.waiting: deque[Request] = deque()
        self.staging: list[Request] = []
        self._head: Request | None = None  # what peek returned: pop takes exactly that request

    def add(self, req: Request) -> None:
        """A new arrival joins the FIFO queue."""
        self.waiting.append(req)

    def add_front(self, req: Request) -> None:
        """A re-queued request (preempted, skipped, forked) goes back to staging, ahead of every arrival."""
        self.staging.append(req)
        self._head = None

    def rank(self, req: Request) -> tuple[int, float]:
        """The policy's order (smaller first): remaining tokens less prefix-cache hits, then arrival."""
        return remaining_tokens(req, self.max_model_len) - self._hit_tokens(req), req.arrival_time

    def peek(self) -> Request:
        """The staged request with the least remaining work (staging the next FIFO batch if it is empty)."""
        if not self.staging:
            for _ in range(min(self.staging_size, len(self.waiting))):
                self.staging.append(self.waiting.popleft())
        self._head = min(self.staging, key=self.rank)
        return self._head

    def pop(self) -> Request:
        """Take the request the last `peek` returned."""
        req = self._head if self._head is not None else self.peek()
        self._head = None
        self.staging.remove(req)
        return req

    def admitted(self, req: Request) -> None:
        """Two-level needs no aging: nothing to count."""

    def remove(self, req: Request) -> None:
        """Drop a waiting request (an abort)."""
        if req is self._head:
            self._head = None
        if req in self.staging:
            self.staging.remove(req)
        else:
            self.waiting.remove(req)

    def __len__(self) -> int:
        return len(self.staging) + len(self.waiting)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(list(self.staging), list(self.waiting))


def make_policy_queue(config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> SRTFQueue | TwoLevelQueue:
    """The waiting queue of an srtf or two-level scheduler."""
    if config.policy == "srtf":
        return SRTFQueue(config.max_model_len, config.max_passed_over, kv_cache_manager)
    if config.policy == "two-level":
        return TwoLevelQueue(config.max_model_len, config.staging_size, kv_cache_manager)
    raise ValueError(f"no policy queue for scheduling_policy {config.policy!r}")
