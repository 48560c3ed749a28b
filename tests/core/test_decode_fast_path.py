"""KVCacheManager.allocate_slots' decode fast path (a step inside the block the request already holds): it gives
the same tables, hashes and cached blocks as the full path, and steps aside for a new block, a filled block (to be
hashed) and a shared block (copy-on-write after a fork)."""

from __future__ import annotations

from pagemill.core.kv_cache_manager import KVCacheManager
from pagemill.request import Request
from pagemill.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64, ignore_eos=True), None, 0.0)


def _decode(mgr: KVCacheManager, req: Request, steps: int) -> list[int]:
    """`steps` decode steps of one token (the token appended as the runner would); block counts after each."""
    counts = []
    for k in range(steps):
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token(100 + k)
        counts.append(len(mgr.groups[0].req_to_blocks[req.request_id]))
    return counts


def _state(mgr: KVCacheManager, rid: str) -> tuple:
    g = mgr.groups[0]
    cached = {key: block.block_id for key, block in mgr.block_pool.cached_block_hash_to_block.items()}
    return [b.block_id for b in g.req_to_blocks[rid]], g.num_cached_blocks.get(rid), mgr._num_stored[rid], cached


def test_the_fast_path_leaves_what_the_full_path_leaves():
    fast, full = (KVCacheManager(num_blocks=32, block_size=BS) for _ in range(2))
    full._all_full = False  # (the full path only)
    reqs = {}
    for name, mgr in (("fast", fast), ("full", full)):
        req = _req("r", [5, 6, 7, 8, 9, 10])  # 1.5 blocks of prompt
        assert mgr.allocate_slots(req, 6) is not None
        req.num_computed_tokens = 6
        reqs[name] = (req, _decode(mgr, req, 11))
    assert reqs["fast"][1] == reqs["full"][1] == [2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5]
    assert _state(fast, "r") == _state(full, "r") and len(_state(fast, "r")[3]) == 4  # 4 full blocks cached
    assert reqs["fast"][0].block_hashes == reqs["full"][0].block_hashes


def test_a_shared_block_after_a_fork_takes_the_full_path():
    mgr = KVCacheManager(num_blocks=32, block_size=BS)
    parent = _req("p", [5, 6, 7, 8, 9, 10])
    assert mgr.allocate_slots(parent, 6) is not None
    parent.num_computed_tokens = 6
    child = _req("c", [5, 6, 7, 8, 9, 10])
    child.num_computed_tokens = 6
    mgr.fork(parent, child, 6)
    shared = mgr.groups[0].req_to_blocks["c"][1]
    assert shared.ref_cnt == 2
    assert mgr._within_block(child, 1, 0) is None  # its next token lands in a shared block
    assert mgr.allocate_slots(child, 1) is not None  # copy-on-write
    assert mgr.groups[0].req_to_blocks["c"][1] is not shared and shared.ref_cnt == 1
    assert mgr._within_block(parent, 1, 0) is not None  # the parent's block is its own again
