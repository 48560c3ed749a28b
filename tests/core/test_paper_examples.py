"""The PagedAttention paper's worked examples (Fig. 6, 8, 9) on the block manager, plus property tests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagemill.core.kv_cache_manager import KVCacheManager
from pagemill.request import Request
from pagemill.sampling_params import SamplingParams
from tests.core.test_scheduler_invariants import check_invariants_of_manager


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64, ignore_eos=True), None, 0.0)


def _compute(mgr: KVCacheManager, req: Request, n: int) -> list:
    """Allocate and 'compute' n more tokens of req (append sampled tokens when past the prompt)."""
    blocks = mgr.allocate_slots(req, n)
    assert blocks is not None
    req.num_computed_tokens += n
    return blocks[0]


def test_fig6_decode_fills_a_block_then_allocates():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    req = _req("a", [1, 2, 3, 4, 5, 6, 7])  # 7 prompt tokens: 2 blocks, the second one 3/4 full
    _compute(mgr, req, 7)
    assert len(mgr.groups[0].req_to_blocks["a"]) == 2
    req.append_output_token(8)  # fills the last slot of block 2
    assert _compute(mgr, req, 1) == []
    req.append_output_token(9)  # needs a new block
    assert len(_compute(mgr, req, 1)) == 1 and len(mgr.groups[0].req_to_blocks["a"]) == 3


def test_fig8_parallel_samples_share_then_copy_on_write():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7])
    _compute(mgr, a, 7)
    b = _req("b", [1, 2, 3, 4, 5, 6, 7])
    mgr.fork(a, b, 7)
    b.num_computed_tokens = 7
    shared = list(mgr.groups[0].req_to_blocks["a"])
    assert [x.block_id for x in shared] == mgr.get_block_ids("b")[0] and all(x.ref_cnt == 2 for x in shared)
    a.append_output_token(10)
    _compute(mgr, a, 1)  # a writes into the shared last block: copy-on-write
    copies, _ = mgr.take_step_changes()
    assert copies == [(shared[1].block_id, mgr.groups[0].req_to_blocks["a"][1].block_id)]
    assert mgr.groups[0].req_to_blocks["a"][0] is mgr.groups[0].req_to_blocks["b"][0]  # the full first block stays shared
    b.append_output_token(11)
    _compute(mgr, b, 1)  # b is now the only owner: writes in place, no copy
    assert mgr.take_step_changes()[0] == [] and mgr.num_cow_copies == 1
    check_invariants_of_manager(mgr)


def test_fig9_beam_search_frees_exactly_the_pruned_beams_blocks():
    mgr = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False)
    root = _req("root", list(range(1, 9)))  # 8 tokens = 2 full blocks
    _compute(mgr, root, 8)
    beams = []
    for i in range(4):
        beam = _req(f"b{i}", list(range(1, 9)))
        mgr.fork(root, beam, 8)
        beam.num_computed_tokens = 8
        beams.append(beam)
    mgr.free(root)
    for i, beam in enumerate(beams):
        for t in range(4):  # each beam fills its own third block
            beam.append_output_token(100 + i)
            _compute(mgr, beam, 1)
    free_before = mgr.block_pool.get_num_free_blocks()
    mgr.free(beams[1])  # prune two beams
    mgr.free(beams[3])
    # Exactly their private blocks come back; the shared prompt blocks stay (ref count 2).
    assert mgr.block_pool.get_num_free_blocks() == free_before + 2
    assert all(b.ref_cnt == 2 for b in mgr.groups[0].req_to_blocks["b0"][:2])
    check_invariants_of_manager(mgr)


ops = st.lists(st.tuples(st.sampled_from(["new", "fork", "append", "free", "preempt", "hit"]),
                         st.integers(0, 1000)), min_size=1, max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 8]), caching=st.booleans())
def test_random_fork_append_free_sequences(ops, block_size, caching):
    mgr = KVCacheManager(num_blocks=48, block_size=block_size, enable_caching=caching)
    live: dict[str, Request] = {}
    n = 0
    shared_prompt = [7, 8, 9, 10, 11, 12, 13]
    for op, x in ops:
        if op in ("new", "hit") or not live:
            tokens = (shared_prompt if op == "hit" else []) + [x % 50 + 1 for _ in range(1 + x % 9)]
            req = _req(f"r{n}", tokens)
            n += 1
            hits, num_hit = mgr.get_computed_blocks(req)
            assert num_hit % block_size == 0 and num_hit < req.num_tokens
            if mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                live[req.request_id] = req
        else:
            req = live[sorted(live)[x % len(live)]]
            if op == "fork":
                child = _req(f"r{n}", list(req.all_token_ids))
                n += 1
                mgr.fork(req, child, req.num_tokens)
                child.num_computed_tokens = req.num_tokens
                live[child.request_id] = child
            elif op == "append":
                req.append_output_token(x % 50 + 1)
                written = mgr.groups[0].req_to_blocks[req.request_id]
                before = {b.block_id: b.ref_cnt for b in written}
                if mgr.allocate_slots(req, 1) is None:
                    req.all_token_ids.pop(), req.output_token_ids.pop()
                else:
                    # the block written by this token is never shared
                    target = mgr.groups[0].req_to_blocks[req.request_id][req.num_computed_tokens // block_size]
                    assert target.ref_cnt == 1, before
                    req.num_computed_tokens += 1
            else:  # free / preempt both release every block
                mgr.free(req)
                del live[req.request_id]
        mgr.take_step_changes()
        check_invariants_of_manager(mgr)
        for r in live.values():  # waste per sequence under one block
            assert len(mgr.groups[0].req_to_blocks[r.request_id]) * block_size - r.num_computed_tokens < block_size
    for r in list(live.values()):
        mgr.free(r)
    assert mgr.block_pool.get_num_free_blocks() == mgr.block_pool.num_blocks - 1
