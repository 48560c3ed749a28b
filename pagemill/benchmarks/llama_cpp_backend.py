"""llama.cpp backends for `bench throughput|latency --compare llama.cpp`.

- `LlamaBatchedBenchBackend` (fixed lengths): one llama-batched-bench process per run: B sequences of PP
  random prompt tokens prefilled together, then OUT-1 decode steps of B tokens (the prefill's logits give
  each sequence its first token, as in pagemill). The time is llama.cpp's own T_PP + T_TG (model load and
  process start excluded); no token ids come back.
- `LlamaServerBackend` (any lengths): llama-server with one slot per concurrent request; every request is
  sent at once to /completion with the same prompt token ids, `n_predict`, `ignore_eos`, temperature 0 and
  `cache_prompt: false` (pagemill's prefix cache is off too); the time is wall time from the first send to
  the last answer, and greedy token ids come back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

from pagemill.benchmarks.llama_cpp import VERSION, ManagedServer, llama_server, run_batched_bench

NAME = "llama.cpp"
MODES = ("auto", "batched-bench", "server")


@dataclass
class TimedOutputs:
    """A run that timed itself: `seconds` replaces the wall time; `outputs` is None without token ids."""

    seconds: float
    outputs: list[list[int]] | None
    output_tokens: int
    detail: dict[str, Any]


def uniform_shape(prompts: Sequence[Sequence[int]], output_lens: Sequence[int]) -> tuple[int, int] | None:
    """(prompt length, output length) when all requests share them, else None."""
    if not prompts or len({len(p) for p in prompts}) != 1 or len(set(output_lens)) != 1:
        return None
    return len(prompts[0]), int(output_lens[0])


def choose_mode(mode: str, prompt_lens: Sequence[int], output_lens: Sequence[int], max_num_seqs: int) -> str:
    """`auto`: batched-bench for fixed lengths and at most `max_num_seqs` requests (one batch), else server."""
    if mode not in MODES:
        raise ValueError(f"--llama-cpp-mode must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    fixed = len(set(prompt_lens)) == 1 and len(set(output_lens)) == 1
    return "batched-bench" if fixed and len(prompt_lens) <= max_num_seqs else "server"


class LlamaBatchedBenchBackend:
    """Fixed-length batches timed by llama-batched-bench (one process per run)."""

    name = NAME
    self_timed = True

    def __init__(self, model: str, threads: int) -> None:
        self.model = model
        self.threads = threads
        self.last_row: Any = None

    def generate(self, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                 use_tqdm: bool = False) -> TimedOutputs:
        """Time B=len(prompts) sequences of the common prompt length and output length."""
        shape = uniform_shape(prompts, output_lens)
        if shape is None:
            raise ValueError("llama-batched-bench needs equal prompt and output lengths; use --llama-cpp-mode server")
        pp, out = shape
        row = run_batched_bench(self.model, pp, max(0, out - 1), len(prompts), self.threads)
        self.last_row = row
        seconds = row.t_pp + (row.t_tg if out > 1 else 0.0)
        return TimedOutputs(seconds, None, len(prompts) * out, {"llama_batched_bench": vars(row)})

    def describe(self) -> str:
        """Short configuration text."""
        return (f"llama.cpp {VERSION} (llama-cpp-python vendored tree, GGML_NATIVE) llama-batched-bench, "
                f"-t {self.threads}, random prompt tokens, time = T_PP + T_TG after a 1-sequence warm-up row")

    def close(self) -> None:
        """Nothing to release."""


class LlamaServerBackend:
    """All requests sent at once to a llama-server with one slot per request (up to `parallel`)."""

    name = NAME
    self_timed = False

    def __init__(self, model: str, threads: int, parallel: int, per_slot_ctx: int) -> None:
        self.threads = threads
        self.parallel = parallel
        self.server: ManagedServer = llama_server(model, threads, parallel, per_slot_ctx).start()

    async def _run(self, prompts: Sequence[Sequence[int]], output_lens: Sequence[int]) -> list[list[int]]:
        import aiohttp

        url = self.server.base_url + "/completion"
        timeout = aiohttp.ClientTimeout(total=6 * 3600)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            async def one(ids: Sequence[int], n: int) -> list[int]:
                body = {"prompt": list(ids), "n_predict": int(n), "ignore_eos": True, "temperature": 0.0,
                        "return_tokens": True, "stream": False, "cache_prompt": False}
                async with session.post(url, json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"llama-server HTTP {resp.status}: {(await resp.text())[:500]}")
                    data = await resp.json()
                return [int(t) for t in data.get("tokens") or []]

            return list(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, output_lens))))

    def generate(self, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                 use_tqdm: bool = False) -> list[list[int]]:
        """Greedy output token ids per request, in input order."""
        return asyncio.run(self._run(prompts, output_lens))

    def describe(self) -> str:
        """Short configuration text."""
        return (f"llama.cpp {VERSION} llama-server -np {self.parallel} -t {self.threads}, all requests "
                f"at once to /completion (token-id prompts, ignore_eos, temperature 0)")

    def close(self) -> None:
        """Stop the server."""
        self.server.stop()
