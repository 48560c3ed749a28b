"""Soak a real `pagemill serve`: many short requests of every kind, then the resident memory of each process before
and after, and the KV pool (it must be empty).

    python benchmarks/soak_server.py                    # 10,000 requests, 16 at a time, the embedded model
    python benchmarks/soak_server.py --requests 2000 --concurrency 8

The mix: chat and completions, streamed and not, n = 1 or 2, max_tokens 1-16, some with logprobs, some cut off by
the client (disconnects), some bad (400s). RSS is read from /proc after a warm-up of --warmup requests and again at
the end, once the engine core has been idle for a few seconds (it returns freed heap pages to the OS when idle).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    """A process's resident set size in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    """Direct child processes."""
    out: list[int] = []
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        out += [int(p) for p in f.read_text().split()]
    return out


def engine_core(pid: int) -> int:
    """The engine core child of a server (multiprocessing's spawned process, not its resource tracker)."""
    for child in children(pid):
        if "spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
            return child
    raise RuntimeError(f"no engine core under pid {pid}")


def metric(text: str, name: str) -> float:
    """One unlabelled-or-model-labelled value of a Prometheus text."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def request_body(rng: random.Random, i: int) -> tuple[str, dict, bool, bool]:
    """(path, body, stream, disconnect early) of request i."""
    stream = rng.random() < 0.4
    n = 2 if rng.random() < 0.15 else 1
    body: dict = {"max_tokens": rng.randint(1, 16), "temperature": rng.choice([0, 0.8]), "n": n, "stream": stream}
    if rng.random() < 0.05:
        body["temperature"] = -1  # a 400
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": f"Request {i}: say something about {rng.randrange(1000)}."}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 3
        return "/v1/chat/completions", body, stream, stream and rng.random() < 0.2
    body["prompt"] = f"Request {i}: the number {rng.randrange(10**6)} is"
    if rng.random() < 0.2:
        body["logprobs"] = 2
    return "/v1/completions", body, stream, stream and rng.random() < 0.2


async def one(client: httpx.AsyncClient, path: str, body: dict, stream: bool, disconnect: bool) -> int:
    """Send one request; returns its status."""
    if not stream:
        return (await client.post(path, json=body)).status_code
    async with client.stream("POST", path, json=body) as r:
        async for _ in r.aiter_lines():
            if disconnect:
                break  # closing the stream early: the server must abort the request
        return r.status_code


async def soak(url: str, total: int, concurrency: int, seed: int) -> dict[int, int]:
    """Run `total` requests, `concurrency` at a time; counts by status."""
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while not queue.empty():
                i = queue.get_nowait()
                status = await one(client, *request_body(rng, i))
                statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def main() -> None:
    """Start the server, warm up, soak, report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="measure RSS after each of this many rounds of --requests "
                    "(growth that levels off is a bounded cache; growth that does not is a leak)")
    ap.add_argument("--serve-args", default="--kv-cache-memory 256MiB --max-model-len 1024")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open("/tmp/pagemill-soak-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagemill.entrypoints.cli", "serve", "--port", str(port),
                             "--disable-uvicorn-access-log", "--disable-log-stats", *args.serve_args.split()],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        core = engine_core(proc.pid)
        asyncio.run(soak(url, args.warmup, args.concurrency, args.seed + 1))
        time.sleep(3)
        before = {"api server": rss_kib(proc.pid), "engine core": rss_kib(core)}
        for r in range(args.rounds):
            t0 = time.monotonic()
            statuses = asyncio.run(soak(url, args.requests, args.concurrency, args.seed + 100 * r))
            elapsed = time.monotonic() - t0
            time.sleep(3)  # the engine core trims its heap after a second idle
            after = {"api server": rss_kib(proc.pid), "engine core": rss_kib(core)}
            print(f"round {r + 1}: {args.requests} requests in {elapsed:.0f} s ({args.requests / elapsed:.1f} "
                  f"req/s), statuses {dict(sorted(statuses.items()))}")
            for name in before:
                delta = after[name] - before[name]
                print(f"{name:>11}: RSS {before[name] / 1024:.1f} MiB -> {after[name] / 1024:.1f} MiB "
                      f"({delta / 1024:+.1f} MiB, {delta * 1024 / args.requests:+.0f} bytes per request)")
            before = after
        m = httpx.get(url + "/metrics", timeout=10).text
        free, total = metric(m, "pagemill:kv_cache_free_blocks"), metric(m, "pagemill:kv_cache_total_blocks")
        running = metric(m, "pagemill:num_requests_running")
        print(f"KV pool after: {free:.0f} of {total:.0f} blocks free; requests running: {running:.0f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()


if __name__ == "__main__":
    main()
