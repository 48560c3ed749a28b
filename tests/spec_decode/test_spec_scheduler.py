"""The scheduler with speculative decoding, driven without a model: random drafts, random acceptance, preemption,
prefix caching and aborts; block-pool invariants, rollback and the runner's view of the block tables after every
step."""

from __future__ import annotations

import random

import pytest

from pagemill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagemill.core.kv_cache_manager import cdiv
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.core.scheduler import Scheduler
from pagemill.request import Request, RequestStatus
from pagemill.sampling_params import SamplingParams
from pagemill.spec_decode.backoff import SpeculativeBackoff
from tests.core.test_scheduler_invariants import check_invariants


def speculative_scheduler(scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_cache_config: KVCacheConfig,
                          spec: SpeculativeConfig) -> Scheduler:
    """A scheduler that speculates, with the engine's back-off as its draft policy."""
    return Scheduler(scheduler_config, cache_config, kv_cache_config, spec, draft_policy=SpeculativeBackoff(spec))


def test_a_speculating_scheduler_needs_a_draft_policy():
    with pytest.raises(ValueError, match="draft_policy"):
        Scheduler(SchedulerConfig(), CacheConfig(block_size=4), KVCacheConfig(16, 4), SpeculativeConfig())


class RunnerTables:
    """The block tables as the model runner rebuilds them from scheduler outputs only."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tables.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
        for c in so.scheduled_cached_reqs:
            table = self.tables[c.req_id]
            if c.num_blocks_kept is not None:
                del table[c.num_blocks_kept:]
            for _, idx, block_id in c.replaced_block_ids or ():
                table[idx] = block_id
            table.extend(c.new_block_ids[0])


def make_scheduler(rng: random.Random, method: str, k: int) -> Scheduler:
    num_blocks, block_size = rng.choice([16, 24, 48]), rng.choice([2, 4, 8])
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, max_batch_size=1000,
                             min_acceptance_rate=rng.choice([0.0, 0.3]))
    sched = SchedulerConfig(max_num_seqs=rng.choice([2, 4, 16]), max_num_batched_tokens=rng.choice([8, 16, 64]),
                            max_model_len=(num_blocks - 1) * block_size - 2 * k)
    return speculative_scheduler(sched, CacheConfig(block_size=block_size, enable_prefix_caching=rng.random() < 0.7),
                                 KVCacheConfig(num_blocks, block_size), spec)


def step(s: Scheduler, rng: random.Random, tables: RunnerTables, counts: dict[str, int]) -> None:
    """One scheduled step with random verification results and random next drafts."""
    so = s.schedule()
    assert so.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
    tables.apply(so)
    for rid, n in so.num_scheduled_tokens.items():
        req = s.requests[rid]
        drafts = so.scheduled_spec_decode_tokens.get(rid, [])
        assert len(drafts) <= s.spec_config.num_speculative_tokens
        if drafts:  # a verifying request schedules its last token and its drafts
            assert req.num_computed_tokens == req.num_tokens + len(drafts)
        assert tables.tables[rid] == [b.block_id for b in s.kv_cache_manager.groups[0].req_to_blocks[rid]]
    sampled, proposals = {}, {}
    for rid in so.num_scheduled_tokens:
        req = s.requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            continue  # a prefill chunk: nothing sampled
        drafts = so.scheduled_spec_decode_tokens.get(rid, [])
        accepted = rng.randint(0, len(drafts))
        sampled[rid] = drafts[:accepted] + [rng.randrange(3, 50)]
        if rid in so.num_spec_tokens_to_propose:
            proposals[rid] = [rng.randrange(3, 50) for _ in range(rng.randint(0, so.num_spec_tokens_to_propose[rid]))]
    before = {rid: s.requests[rid].num_computed_tokens for rid in sampled}
    for out in s.update_from_output(so, ModelRunnerOutput(sampled, draft_token_ids=proposals)):
        counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    for rid, toks in sampled.items():
        req = s.requests.get(rid)
        if req is None:
            continue
        rejected = len(so.scheduled_spec_decode_tokens.get(rid, [])) + 1 - len(toks)
        assert req.num_computed_tokens == before[rid] - rejected == req.num_tokens - 1  # rolled back
        for g in s.kv_cache_manager.groups:
            # the blocks of rejected drafts are freed; cached (hashed) blocks hold committed tokens only
            assert len(g.req_to_blocks[rid]) <= max(cdiv(req.num_computed_tokens + 1, s.block_size),
                                                    len(g.req_to_blocks[rid]) if not rejected else 0)
            assert g.num_cached_blocks.get(rid, 0) * s.block_size <= req.num_tokens
    check_invariants(s)


@pytest.mark.parametrize("seed", range(16))
def test_random_workload_with_speculation(seed):
    rng = random.Random(seed)
    k = rng.randint(1, 8)
    s = make_scheduler(rng, rng.choice(["ngram", "draft_model"]), k)
    tables, counts = RunnerTables(), {}
    shared = [rng.randrange(3, 50) for _ in range(12)]
    max_tokens = {}
    for n in range(80):
        if rng.random() < 0.4:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))]
            sp = SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True,
                                speculative_decoding=rng.random() < 0.9)
            s.add_request(Request(f"r{n}", prompt[: s.config.max_model_len - 1], sp, None, float(n)))
            max_tokens[f"r{n}"] = sp.max_tokens
        if rng.random() < 0.05 and s.requests:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
        if s.has_unfinished_requests():
            step(s, rng, tables, counts)
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        step(s, rng, tables, counts)
    assert not s.has_unfinished_requests()
    for rid, n in counts.items():
        assert n <= max_tokens[rid]  # drafts never take a request past max_tokens
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    spec = s.make_stats().spec_decoding
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens


def test_back_off_after_poor_acceptance_then_retry():
    s = speculative_scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=512), CacheConfig(block_size=4),
                              KVCacheConfig(200, 4), SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    s.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), None, 0.0))
    drafted = []
    for _ in range(120):
        so = s.schedule()
        drafts = so.scheduled_spec_decode_tokens.get("r", [])
        drafted.append(len(drafts))
        proposals = {"r": [9, 9, 9, 9]} if "r" in so.num_spec_tokens_to_propose else {}
        s.update_from_output(so, ModelRunnerOutput({"r": [8]}, draft_token_ids=proposals))  # every draft rejected
    assert drafted[1] == 4 and drafted.count(4) < 16  # backs off, tries again now and then
    assert 0 in drafted[-20:]


def test_no_drafts_for_a_large_batch_or_an_opted_out_request():
    s = speculative_scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=512), CacheConfig(block_size=4),
                              KVCacheConfig(400, 4), SpeculativeConfig(method="ngram", max_batch_size=4))
    for i in range(4):
        s.add_request(Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), None, float(i)))
    assert not s.schedule().num_spec_tokens_to_propose  # 4 running: the back-off's batch size
    s2 = speculative_scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=512),
                               CacheConfig(block_size=4), KVCacheConfig(400, 4), SpeculativeConfig(method="ngram"))
    s2.add_request(Request("in", [5, 6, 7], SamplingParams(max_tokens=50), None, 0.0))
    s2.add_request(Request("out", [5, 6, 7], SamplingParams(max_tokens=50, speculative_decoding=False), None, 1.0))
    assert set(s2.schedule().num_spec_tokens_to_propose) == {"in"}


def test_costly_drafts_back_off_and_new_requests_start_backed_off():
    """A draft model whose proposals cost ~0.8 of a target step needs more than 80% acceptance to pay: 50% backs
    off, and once acceptance is poor engine-wide a new request starts backed off instead of re-learning it."""
    s = speculative_scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=2048), CacheConfig(block_size=4),
                              KVCacheConfig(2000, 4), SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    drafted: dict[str, int] = {}

    def run(rid: str, steps: int) -> None:
        s.add_request(Request(rid, [5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True), None, 0.0))
        for _ in range(steps):
            so = s.schedule()
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            drafted[rid] = drafted.get(rid, 0) + bool(drafts)
            proposals = {rid: [9, 9, 9, 9]} if rid in so.num_spec_tokens_to_propose else {}
            s.update_from_output(so, ModelRunnerOutput({rid: drafts[:len(drafts) // 2] + [8]},
                                                       draft_token_ids=proposals, draft_cost=0.8))
        s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    run("first", 200)
    assert 3 <= drafted["first"] <= 12  # half of the drafts accepted: not worth 0.8 of a step each
    run("second", 40)
    assert drafted["second"] <= 1  # starts backed off


def test_after_a_poor_spell_short_requests_still_probe_and_speculation_recovers():
    """Every draft rejected for a while backs off to 256 tokens; a later request of 64 tokens still probes within
    its length (one poor spell must not stop speculation for good), and once drafts are accepted again new
    requests draft from their first step."""
    s = speculative_scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=2048), CacheConfig(block_size=4),
                              KVCacheConfig(2000, 4), SpeculativeConfig(method="ngram", num_speculative_tokens=4))

    def run(rid: str, max_tokens: int, accept: bool) -> list[int]:
        s.add_request(Request(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, 0.0))
        drafted = []
        while rid in s.requests and len(drafted) < 2000:
            so = s.schedule()
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            drafted.append(len(drafts))
            proposals = {rid: [9, 9, 9, 9]} if rid in so.num_spec_tokens_to_propose else {}
            s.update_from_output(so, ModelRunnerOutput({rid: (drafts if accept else []) + [8]},
                                                       draft_token_ids=proposals))
        return drafted

    for i in range(10):
        run(f"poor{i}", 1000, accept=False)
        if s.draft_policy.spec_acceptance < s.draft_policy.acceptance_threshold():
            break
    policy = s.draft_policy
    assert policy.spec_backoff_len == 256 and policy.spec_acceptance < policy.acceptance_threshold()  # poor engine-wide
    short = run("short", 64, accept=True)
    assert not any(short[:8]) and any(short)  # backed off at first, then a probe inside its 64 tokens
    for i in range(12):
        drafted = run(f"good{i}", 64, accept=True)
    assert drafted[1] == 4  # acceptance recovered engine-wide: the next request drafts at once
