"""The shared-memory all-reduce / all-gather (csrc/shm/shm_comm.cpp) between real processes, against torch.distributed's
gloo results: random tensors of several sizes and dtypes, many collectives in a row, the gloo fallback for large
tensors, a dead or stuck peer turned into an error, and no segment left in /dev/shm.

Exactness: every rank sums the ranks' inputs in rank order (float32; 16-bit inputs accumulated in float32 and rounded
once), so the result equals that fixed-order sum bit for bit on every rank. Gloo's order is its own: with 2 ranks a
sum is one addition (commutative, so bit-exact); with 3 the order differs, so gloo's result is compared within one
rounding per addition (rtol 1e-6 float32; bfloat16 within its 8-bit mantissa).
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import pytest
import torch

from tests.conftest import requires_kernels, requires_shm_comm

pytestmark = [requires_kernels, requires_shm_comm]

SIZES = [4 << 10, 64 << 10, 1 << 20]  # bytes per rank
ODD_NUMELS = [1, 3, 1023]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/pagemill-tp-*"))


def _inputs(step: int, numel: int, dtype: torch.dtype, world: int) -> list[torch.Tensor]:
    """Every rank's input of one step (each process regenerates all of them)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(step * 1000 + r)
        out.append(torch.randn(numel, generator=g).to(dtype))
    return out


def _fixed_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float() + parts[1].float()
    for p in parts[2:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def _setup(rank: int, world: int, port: int, env: dict[str, str], timeout_s: float = 600.0):
    import torch.distributed as dist

    from pagemill.distributed.group_coordinator import GroupCoordinator
    from pagemill.distributed.shm_communicator import create_shm_communicator

    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    shm = create_shm_communicator(group, rank, world, timeout_s)
    return GroupCoordinator(list(range(world)), rank, group, shm)


def _equivalence_rank(rank: int, world: int, port: int, results: mp.Queue) -> None:
    """Many collectives in a row: shm against the fixed-order sum (exact) and against gloo."""
    import torch.distributed as dist

    try:
        coord = _setup(rank, world, port, {"PAGEMILL_CPU_SHM_ALLREDUCE_MAX_BYTES": str(1 << 20)})
        assert coord.shm is not None, "shared memory was not set up"
        assert not os.path.exists("/dev/shm" + coord.shm.name), "the segment's name outlived the set-up"
        step = 0
        numels = [n // 4 for n in SIZES] + ODD_NUMELS
        for rnd in range(20):  # sizes and the two slots of each rank alternate; the sequence counters climb
            for numel in numels:
                for dtype in (torch.float32, torch.bfloat16):
                    step += 1
                    parts = _inputs(step, numel, dtype, world)
                    got = coord.all_reduce(parts[rank].clone())
                    want = _fixed_order_sum(parts)
                    assert torch.equal(got, want), (step, numel, dtype)
                    if rnd == 0:  # gloo once per shape (it is the slow one)
                        ref = parts[rank].clone()
                        dist.all_reduce(ref, group=coord.device_group)
                        if world == 2 or dtype == torch.float32:
                            tol = dict(rtol=0, atol=0) if world == 2 else dict(rtol=1e-6, atol=1e-6)
                        else:
                            tol = dict(rtol=1e-2, atol=5e-2)  # two roundings to 8 bits against one
                        torch.testing.assert_close(got, ref, **tol)
            rows = 3
            parts = [p.view(rows, -1) for p in _inputs(step, rows * 1000, torch.float32, world)]
            gathered = coord.all_gather(parts[rank])
            assert torch.equal(gathered, torch.cat(parts, dim=-1)), ("all_gather", rnd)
        # larger than the slot: gloo, in step with the shared-memory collectives around it
        big = _inputs(0, (2 << 20) // 4, torch.float32, world)
        assert not coord.shm.supports(big[rank])
        got = coord.all_reduce(big[rank].clone())
        torch.testing.assert_close(got, _fixed_order_sum(big), rtol=1e-6, atol=1e-6)
        small = _inputs(1, 8, torch.float32, world)
        assert torch.equal(coord.all_reduce(small[rank].clone()), _fixed_order_sum(small))
        assert coord.shm.comm.sequence > 20 * len(numels) * 2
        coord.destroy()
        dist.destroy_process_group()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _run_ranks(target, world: int, extra: tuple = (), timeout_s: float = 120.0) -> dict[int, str]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, results, *extra), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    out: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world and time.monotonic() < deadline:
            try:
                rank, message = results.get(timeout=1.0)
            except queue.Empty:
                continue
            out[rank] = message
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shm_collectives_match_gloo(world):
    before = _segments()
    results = _run_ranks(_equivalence_rank, world)
    assert results == {r: "ok" for r in range(world)}, "\n".join(str(v) for v in results.values())
    assert _segments() <= before, "a shared-memory segment was left in /dev/shm"


def _disabled_rank(rank: int, world: int, port: int, results: mp.Queue) -> None:
    """Rank 1 forces gloo: no rank uses shared memory, and the collectives still work."""
    try:
        coord = _setup(rank, world, port, {"PAGEMILL_CPU_SHM_ALLREDUCE": "0" if rank == 1 else "1"})
        assert coord.shm is None
        parts = _inputs(5, 100, torch.float32, world)
        assert torch.equal(coord.all_reduce(parts[rank].clone()), _fixed_order_sum(parts))
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_one_rank_forcing_gloo_turns_shm_off_for_all():
    results = _run_ranks(_disabled_rank, 2)
    assert results == {0: "ok", 1: "ok"}, "\n".join(str(v) for v in results.values())


def _dead_peer_rank(rank: int, world: int, port: int, results: mp.Queue, mode: str) -> None:
    """Rank 1 exits (mode 'dead') or idles (mode 'stuck') instead of joining the second collective: rank 0's fails
    with a clear error, soon."""
    try:
        coord = _setup(rank, world, port, {}, timeout_s=1.0)
        assert coord.shm is not None
        coord.all_reduce(torch.ones(16))
        if rank == 1:
            results.put((rank, "ok"))
            results.close()
            results.join_thread()  # flushed before the exit below
            if mode == "dead":
                os._exit(0)
            time.sleep(3)
            return
        start = time.monotonic()
        try:
            coord.all_reduce(torch.ones(16))
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            expected = "is gone" if mode == "dead" else "did not arrive within"
            assert expected in str(e) and "rank 1" in str(e), str(e)
            assert elapsed < 5.0, elapsed
            results.put((rank, "ok"))
            return
        results.put((rank, "the collective returned without its peer"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("mode", ["dead", "stuck"])
def test_missing_peer_is_an_error_not_a_hang(mode):
    results = _run_ranks(_dead_peer_rank, 2, (mode,), timeout_s=60.0)
    assert results == {0: "ok", 1: "ok"}, "\n".join(str(v) for v in results.values())


def _uses_shm(model) -> bool:
    """In a worker: whether its tensor-parallel collectives go through shared memory."""
    from pagemill.layers.linear import RowParallelLinear

    layer = next(m for m in model.modules() if isinstance(m, RowParallelLinear))
    return layer.tp_group.shm is not None


def _pid(model) -> int:
    return os.getpid()


def test_tp2_greedy_matches_single_process_with_shm_and_gloo(tiny_llama, monkeypatch):
    """TP=2 gives the single-process tokens (logprobs within 1e-4) through shared memory and through gloo; no
    segment is left behind, during the run or after shutdown."""
    from pagemill import LLM, SamplingParams
    from pagemill.distributed import cleanup_dist_env_and_memory

    engine = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=16, seed=0)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    want = LLM(tiny_llama, **engine).generate(prompts, params, use_tqdm=False)
    before = _segments()
    for enabled in ("1", "0"):
        monkeypatch.setenv("PAGEMILL_CPU_SHM_ALLREDUCE", enabled)
        llm = LLM(tiny_llama, tensor_parallel_size=2, **engine)
        try:
            assert llm.apply_model(_uses_shm) == [enabled == "1"] * 2
            got = llm.generate(prompts, params, use_tqdm=False)
            pids = llm.apply_model(_pid)
            assert not any(f"pagemill-tp-{pid}-" in seg for seg in _segments() for pid in pids)
        finally:
            llm.llm_engine.engine_core.shutdown()
            cleanup_dist_env_and_memory()
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, (enabled, g.outputs[0].token_ids)
            for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert lg.keys() == lw.keys()
                assert all(abs(lg[t].logprob - lw[t].logprob) < 1e-4 for t in lg), enabled
    assert _segments() <= before
