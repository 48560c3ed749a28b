"""The GPU worker and runner on the CPU (device="cpu", attention_backend="triton": Triton's interpreter): greedy
tokens equal HF transformers float32 on tiny random models of several families in a batch with chunked prefill and
prefix-cache hits; seeded sampling (temperature, top-k/p, min-p, penalties, logit bias) and logprobs equal the CPU
path's; nothing CUDA-specific runs; the CUDA-graph bucket choice and padding; the gpu_memory_utilization arithmetic."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU

import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagemill import LLM, SamplingParams  # noqa: E402
from pagemill.worker.gpu_model_runner import kv_cache_bytes_from_profile  # noqa: E402
from pagemill.worker.step_buffers import StepBuffers, bucket_for, decode_buckets  # noqa: E402
from tests.conftest import SMOL_PROMPTS, hf_greedy  # noqa: E402

GPU_WORKER = "pagemill.worker.gpu_worker.GpuWorker"
GPU_ARGS = dict(attention_backend="triton", worker_cls=GPU_WORKER, device="cpu")


@pytest.fixture(autouse=True)
def _every_kernel_variant():
    """(Overrides any per-ISA parametrisation: these kernels are Triton's.)"""
    yield


@pytest.mark.parametrize("kind,async_scheduling", [("llama", False), ("llama", True), ("qwen3", False),
                                                   ("gemma3_text", False)])
def test_greedy_equals_hf_with_chunks_and_prefix_hits(kind, async_scheduling, tiny_models):
    """A batch of 4 prompts, 16-token steps (chunked prefill, mixed prefill + decode), then the same prompts again
    (prefix-cache hits): greedy tokens equal HF transformers float32 for every request, both times; also with async
    scheduling (step N+1 planned while step N runs)."""
    from transformers import AutoModelForCausalLM

    path = tiny_models[kind]
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8,
              block_size=8, async_scheduling=async_scheduling, **GPU_ARGS)
    assert llm.llm_engine.engine_core.async_scheduling == async_scheduling
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    assert type(runner).__name__ == "GpuModelRunner" and runner.backend.name == "triton"
    assert runner.device == torch.device("cpu") and runner.graphs is None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [p * 2 for p in SMOL_PROMPTS[:4]]  # > 16 tokens each: several chunks
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    refs = [hf_greedy(hf, list(o.prompt_token_ids), 5) for o in first]
    assert [list(o.outputs[0].token_ids) for o in first] == refs
    again = llm.generate(prompts, params, use_tqdm=False)
    assert any(o.num_cached_tokens > 0 for o in again)
    assert [list(o.outputs[0].token_ids) for o in again] == refs


def test_seeded_sampling_and_logprobs_equal_the_cpu_path(tiny_models):
    """Seeded rows draw the CPU path's SplitMix64 uniforms: the same tokens under temperature, top-k / top-p, min-p,
    penalties and logit bias; logprobs within float tolerance."""
    path = tiny_models["llama"]
    common = dict(kv_cache_memory="16MiB", max_model_len=128, block_size=16, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True,
                             logprobs=3),
              SamplingParams(temperature=1.2, min_p=0.05, seed=11, max_tokens=6, ignore_eos=True,
                             presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
              SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True, logit_bias={5: 4.0, 9: -2.0}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)]
    prompts = SMOL_PROMPTS[:4]
    gpu = LLM(path, **common, **GPU_ARGS).generate(prompts, params, use_tqdm=False)
    cpu = LLM(path, attention_backend="torch", **common).generate(prompts, params, use_tqdm=False)
    for g, c in zip(gpu, cpu):
        assert list(g.outputs[0].token_ids) == list(c.outputs[0].token_ids)
        if c.outputs[0].logprobs:
            for lg, lc in zip(g.outputs[0].logprobs, c.outputs[0].logprobs):
                assert lg.keys() == lc.keys()
                for tok in lc:
                    assert abs(lg[tok].logprob - lc[tok].logprob) < 1e-4


def test_nothing_cuda_specific_runs_on_the_cpu(tiny_models):
    """In a fresh process: the CPU platform's engine never imports the CUDA platform or the graph code, and the GPU
    worker on device="cpu" never initialises CUDA nor imports the graph code."""
    code = f"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from pagemill import LLM, SamplingParams
p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
LLM({tiny_models['llama']!r}, kv_cache_memory="8MiB", max_model_len=64).generate(["Hi there"], p, use_tqdm=False)
assert "pagemill.platforms.cuda" not in sys.modules
assert "pagemill.worker.gpu_model_runner" not in sys.modules
LLM({tiny_models['llama']!r}, kv_cache_memory="8MiB", max_model_len=64, attention_backend="triton",
    worker_cls={GPU_WORKER!r}).generate(["Hi there"], p, use_tqdm=False)
assert "pagemill.worker.cuda_graphs" not in sys.modules
assert not torch.cuda.is_initialized()
print("ok")
"""
    env = {**os.environ, "PAGEMILL_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_device_argument():
    from pagemill.engine.arg_utils import resolve_device

    assert resolve_device("auto") == resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device='cuda'.*PAGEMILL_DEVICE=cuda"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_buckets(50)[-3:] == [40, 48, 50]
    b = decode_buckets(256)
    assert b[-1] == 256 and all(x < y for x, y in zip(b, b[1:]))
    assert [bucket_for(n, b) for n in (1, 3, 5, 9, 256)] == [1, 4, 8, 16, 256]
    assert bucket_for(0, b) is None and bucket_for(257, b) is None


def test_step_buffers_pad_a_decode_batch_with_the_null_block():
    """3 decodes padded to bucket 4: the real tokens as given; the padding token is request 3 at position 0 writing
    slot 0 and reading block 0 only."""
    buf = StepBuffers(torch.device("cpu"), max_tokens=8, max_reqs=4, max_blocks=3, num_groups=1)
    buf.np["block_table"][:] = 99  # stale rows from an earlier step
    tables = np.array([[[5, 6, 0], [7, 0, 0], [8, 9, 10]]])
    tokens, reqs = buf.stage(np.array([11, 12, 13]), np.array([20, 3, 40]), np.array([[6 * 16 + 4, 7 * 16 + 3,
                                                                                       10 * 16 + 8]]),
                             np.arange(3), tables, pad_to=4)
    assert (tokens, reqs) == (4, 4)
    ids, pos = buf.views(tokens)
    assert ids.tolist() == [11, 12, 13, 0] and pos.tolist() == [20, 3, 40, 0]
    slots, table, req, tpos = buf.attn_tensors(0, tokens)
    assert slots.tolist() == [100, 115, 168, 0] and req.tolist() == [0, 1, 2, 3] and tpos.tolist() == [20, 3, 40, 0]
    assert table[:3].tolist() == tables[0].tolist() and table[3, 0] == 0
    assert table.dtype == req.dtype == tpos.dtype == torch.int32
    with pytest.raises(ValueError, match="exceeds the runner's buffers"):
        buf.stage(np.zeros(9, dtype=np.int64), np.zeros(9, dtype=np.int64), np.zeros((1, 9), dtype=np.int64),
                  np.zeros(9, dtype=np.int64), tables)


def test_kv_cache_bytes_from_profile():
    gib = 2**30
    assert kv_cache_bytes_from_profile(80 * gib, 0.9, 10 * gib, 1 * gib) == 72 * gib - 11 * gib
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1"):
        kv_cache_bytes_from_profile(80 * gib, 0.1, 10 * gib, 1 * gib)


def test_decode_graph_path_with_padding_equals_hf(tiny_models):
    """The CUDA-graph path on the CPU: "graphs" whose replay re-runs the model over the metadata built once at
    capture from the persistent buffers' views (what a captured graph reads). Decode batches of 5, 3, ... padded to
    buckets 6, 4, ... (null-block padding) give HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from pagemill.forward_context import set_forward_context
    from pagemill.worker.cuda_graphs import DecodeGraphs

    class RerunGraphs(DecodeGraphs):
        def _capture_one(self, runner, size):
            self.model = runner.model
            self.graphs[size] = (self._metadata(runner, size), runner.buffers.views(size))

        def replay(self, size):
            replayed.append(size)
            metadata, (ids, pos) = self.graphs[size]
            with set_forward_context(metadata, None):
                return self.model(ids, pos)

    replayed: list[int] = []
    path = tiny_models["llama"]
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128, max_num_seqs=6, block_size=8, **GPU_ARGS)
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    assert runner.buckets == [1, 2, 4, 6]
    graphs = RerunGraphs()
    for size in runner.buckets:
        graphs._capture_one(runner, size)
    runner.graphs = graphs
    prompts = SMOL_PROMPTS[:5]
    lengths = [6, 3, 6, 4, 2]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
                        use_tqdm=False)
    assert 6 in replayed and 4 in replayed  # 5 decodes -> bucket 6, 3 -> 4
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for o, n in zip(outs, lengths):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, list(o.prompt_token_ids), n)


def test_gguf_dequantized_at_load_on_the_gpu_runner(smol_path, smol_hf, monkeypatch):
    """A GGUF file on a platform without kernels for its blocks (CUDA): quantization auto resolves to none, the
    weights are dequantized at load, and the GPU runner's greedy tokens equal HF transformers on the same file."""
    import pagemill.engine.arg_utils as arg_utils
    from pagemill.engine.arg_utils import EngineArgs
    from pagemill.platforms.cuda import CudaPlatform

    with monkeypatch.context() as m:  # the CUDA platform's quantization menu, on this CPU
        m.setattr(arg_utils, "current_platform", type("Cuda", (), {
            "supported_quantization": CudaPlatform.supported_quantization}))
        assert arg_utils._checkpoint_quantization("auto", True, None) == "none"
    assert arg_utils._checkpoint_quantization("auto", True, None) == "gguf"  # the CPU keeps the blocks
    assert EngineArgs(smol_path, quantization="none").create_engine_config().model_config.quantization == "none"
    llm = LLM(smol_path, quantization="none", kv_cache_memory="64MiB", max_model_len=256,
              attention_backend="torch", worker_cls=GPU_WORKER, device="cpu")
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    assert type(runner).__name__ == "GpuModelRunner"
    hf, tok = smol_hf
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:2]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
