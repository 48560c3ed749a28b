"""All-reduce (and all-gather) latency between tensor-parallel ranks on one host: gloo vs the shared-memory
communicator, float32, sizes 4 KiB..1 MiB per rank, each rank a process pinned to its own core.

    python benchmarks/shm_allreduce.py --world 2 --save-result results/shm_allreduce.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch

DEFAULT_SIZES = "4096,16384,65536,262144,1048576"


def _time(fn: Any, iters: int, barrier: Any) -> float:
    """Median microseconds of one call (after a warm-up), each call started in step with the peers."""
    for _ in range(max(3, iters // 10)):
        fn()
    samples = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _rank(rank: int, world: int, port: int, sizes: list[int], iters: int, out: Any) -> None:
    import torch.distributed as dist

    from pagemill.distributed.group_coordinator import GroupCoordinator
    from pagemill.distributed.shm_communicator import create_shm_communicator

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:
        os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    os.environ.setdefault("PAGEMILL_CPU_SHM_ALLREDUCE_MAX_BYTES", str(max(sizes)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    shm = create_shm_communicator(group, rank, world)
    if shm is None:
        raise RuntimeError("the shared-memory communicator is unavailable (kernels not built?)")
    gloo = GroupCoordinator(list(range(world)), rank, group, None)
    fast = GroupCoordinator(list(range(world)), rank, group, shm)

    def sync() -> None:  # gloo's own barrier: the same for both columns
        dist.barrier(group=group)

    rows = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        row: dict[str, Any] = {"bytes": nbytes}
        for name, coord in (("gloo", gloo), ("shm", fast)):
            row[f"{name}_all_reduce_us"] = round(_time(lambda c=coord: c.all_reduce(x), iters, sync), 1)
            row[f"{name}_all_gather_us"] = round(_time(lambda c=coord: c.all_gather(x), iters, sync), 1)
        rows.append(row)
    if rank == 0:
        out.put(rows)
    fast.destroy()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Spawn `--world` ranks and print the median latencies, gloo and shm side by side."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes per rank, comma-separated")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, sizes, args.iters, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join()
    print(f"{'bytes':>9} {'gloo AR us':>11} {'shm AR us':>10} {'speed-up':>8} {'gloo AG us':>11} {'shm AG us':>10}")
    for r in rows:
        print(f"{r['bytes']:>9} {r['gloo_all_reduce_us']:>11} {r['shm_all_reduce_us']:>10} "
              f"{r['gloo_all_reduce_us'] / r['shm_all_reduce_us']:>7.1f}x {r['gloo_all_gather_us']:>11} "
              f"{r['shm_all_gather_us']:>10}")
    if args.save_result:
        from pagemill.benchmarks.report import environment_info, save_result

        save_result(args.save_result, {"args": vars(args), "rows": rows, "env": environment_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
