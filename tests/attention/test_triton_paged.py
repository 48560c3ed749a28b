"""The Triton paged-attention backend under Triton's interpreter against the torch reference backend: decodes,
prefill chunks after cached context and fresh prefills in one step, block sizes 16 / 32, GQA 1 / 4 / 8, head dims
64 / 128 / 256 and odd ones, sliding windows, float32 and reduced-precision caches."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU
# TRITON_INTERPRET=0 on a machine with a GPU compiles them and runs the same checks on it (the reference stays on
# the CPU: it indexes with numpy-made tensors)

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagemill.attention.backends.torch_paged import TorchPagedAttention  # noqa: E402
from pagemill.attention.backends.triton_paged import TritonPagedAttention  # noqa: E402
from pagemill.attention.metadata import CommonAttentionMetadata  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"


def _run_triton(layer, q, k, v, cache, md, metadata=None, splits=None):
    """The Triton backend's output and cache, computed on DEVICE and brought back to the CPU (`splits`: split-KV
    partitions per token, None: the backend's choice)."""
    backend = TritonPagedAttention(splits)
    dq, dk, dv, dcache = (t.to(DEVICE) for t in (q, k, v, cache))
    out = backend.forward(layer, dq, dk, dv, dcache, metadata or backend.build_metadata(md))
    return out.cpu(), dcache.cpu()



@pytest.fixture(autouse=True)
def _every_kernel_variant():
    """(Overrides the directory's per-ISA parametrisation: these kernels are Triton's, not the C++ variants.)"""
    yield


# (cached tokens, new tokens) per request, decodes first as the backends' batch order asks
STEP = [(9, 1), (40, 1), (0, 1), (5, 7), (0, 13), (17, 3)]


def _step(block_size: int, num_blocks: int, gen: torch.Generator, step: list | None = None
          ) -> CommonAttentionMetadata:
    """A step over `step` (default STEP) with each request's blocks drawn at random from the pool (no two requests
    share one)."""
    STEP = step or globals()["STEP"]  # noqa: N806
    seq_lens = np.array([c + q for c, q in STEP])
    per_req = -(-seq_lens // block_size)
    ids = torch.randperm(num_blocks - 1, generator=gen).numpy() + 1
    table = np.zeros((len(STEP), per_req.max()), dtype=np.int64)
    at = 0
    for i, nb in enumerate(per_req):
        table[i, :nb] = ids[at:at + nb]
        at += nb
    qsl = np.concatenate([[0], np.cumsum([q for _, q in STEP])])
    computed = np.array([c for c, _ in STEP])
    slots = np.concatenate([table[i, (np.arange(c, c + q)) // block_size] * block_size
                            + np.arange(c, c + q) % block_size for i, (c, q) in enumerate(STEP)])
    num_decodes = sum(1 for _, q in STEP if q == 1)
    return CommonAttentionMetadata(len(STEP), num_decodes, int(qsl[-1]), qsl, seq_lens, computed, table,
                                   block_size, torch.from_numpy(slots))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,gqa,head_dim", [(2, 1, 64), (2, 4, 128), (1, 8, 256), (3, 2, 80)])
@pytest.mark.parametrize("window", [None, 6])
def test_matches_the_torch_reference(block_size, num_kv_heads, gqa, head_dim, window):
    gen = torch.Generator().manual_seed(block_size * 1000 + head_dim + gqa)
    md = _step(block_size, num_blocks=16 if block_size == 32 else 24, gen=gen)
    t, hq = md.num_actual_tokens, num_kv_heads * gqa
    q = torch.randn(t, hq, head_dim, generator=gen)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    cache = torch.randn(TorchPagedAttention.kv_cache_shape(md.block_table.max() + 1, block_size, num_kv_heads,
                                                           head_dim), generator=gen)  # the cached context
    layer = SimpleNamespace(num_kv_heads=num_kv_heads, head_dim=head_dim, scale=head_dim ** -0.5,
                            sliding_window=window)
    ref_cache = cache.clone()
    want = TorchPagedAttention().forward(layer, q, k, v, ref_cache, TorchPagedAttention().build_metadata(md))
    got, tri_cache = _run_triton(layer, q, k, v, cache, md)
    torch.testing.assert_close(tri_cache, ref_cache, rtol=0, atol=0)  # the new K/V, in their slots
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_cache(cache_dtype):
    """A bf16 / fp16 cache: the new K/V stored rounded, attention over what was stored (as the reference)."""
    gen = torch.Generator().manual_seed(7)
    md = _step(16, 24, gen)
    t = md.num_actual_tokens
    q, k, v = (torch.randn(t, h, 64, generator=gen) for h in (8, 2, 2))
    cache = torch.randn(TorchPagedAttention.kv_cache_shape(24, 16, 2, 64), generator=gen).to(cache_dtype)
    layer = SimpleNamespace(num_kv_heads=2, head_dim=64, scale=0.125, sliding_window=None)
    ref_cache = cache.clone()
    want = TorchPagedAttention().forward(layer, q, k, v, ref_cache, TorchPagedAttention().build_metadata(md))
    got, tri_cache = _run_triton(layer, q, k, v, cache, md)
    torch.testing.assert_close(tri_cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [None, 4])
def test_half_precision_model(dtype, splits):
    """A bf16 / fp16 model: the products in its dtype, float32 accumulation, probabilities rounded to it before
    the value product (as FlashAttention): within half-precision rounding of the float32 reference over the same
    values, for decodes, prefill tiles and split-KV."""
    gen = torch.Generator().manual_seed(11)
    md = _step(16, 40, gen, step=LONG_STEP + [(0, 13)])
    t = md.num_actual_tokens
    q, k, v = (torch.randn(t, h, 64, generator=gen).to(dtype) for h in (8, 2, 2))
    cache = torch.randn(TorchPagedAttention.kv_cache_shape(40, 16, 2, 64), generator=gen).to(dtype)
    layer = SimpleNamespace(num_kv_heads=2, head_dim=64, scale=0.125, sliding_window=None)
    ref = TorchPagedAttention()
    want = ref.forward(layer, q.float(), k.float(), v.float(), cache.float(), ref.build_metadata(md))
    got, _ = _run_triton(layer, q, k, v, cache, md, splits=splits)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_a_wrong_kernel_is_caught():
    """The comparison can fail: attention without the causal limit differs from the reference."""
    gen = torch.Generator().manual_seed(3)
    md = _step(16, 24, gen)
    t = md.num_actual_tokens
    q, k, v = (torch.randn(t, h, 64, generator=gen) for h in (4, 2, 2))
    cache = torch.randn(TorchPagedAttention.kv_cache_shape(24, 16, 2, 64), generator=gen)
    layer = SimpleNamespace(num_kv_heads=2, head_dim=64, scale=0.125, sliding_window=None)
    want = TorchPagedAttention().forward(layer, q, k, v, cache.clone(), TorchPagedAttention().build_metadata(md))
    meta = TritonPagedAttention().build_metadata(md)
    device = torch.device(DEVICE)
    table, req, pos = meta.tensors(device)
    meta._tensors[device.type] = (table, req, torch.full_like(pos, 0))  # every token sees only key 0
    got, _ = _run_triton(layer, q, k, v, cache, md, meta)
    assert not torch.allclose(got, want, atol=1e-3)


@pytest.mark.skipif(DEVICE != "cpu", reason="the engine runs Triton on the CPU platform only (the interpreter)")
def test_engine_greedy_equals_hf(tiny_models):
    """A whole engine on attention_backend="triton" (the interpreter on the CPU): a batch of prompts, chunked
    prefill and decode steps, greedy tokens equal to HF transformers float32."""
    from transformers import AutoModelForCausalLM

    from pagemill import LLM, SamplingParams
    from tests.conftest import SMOL_PROMPTS, hf_greedy

    path = tiny_models["llama"]
    llm = LLM(path, attention_backend="triton", kv_cache_memory="16MiB", max_model_len=256,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    assert llm.llm_engine.engine_core.executor.model_runner.backend.name == "triton"
    prompts = SMOL_PROMPTS[:3]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, list(out.prompt_token_ids), 6)


# long decode contexts (split-KV's case) next to a prefill chunk
LONG_STEP = [(200, 1), (67, 1), (5, 1), (90, 4)]


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("block_size,gqa,head_dim,window", [(16, 4, 64, None), (32, 1, 128, None),
                                                             (16, 8, 256, 50), (32, 2, 80, 7)])
def test_split_kv_matches_the_torch_reference(splits, block_size, gqa, head_dim, window):
    """Split-KV (flash-decoding): each token's keys over `splits` programs, then the reduction; long and short
    contexts (empty splits), sliding windows, odd head dims: equal to the reference."""
    gen = torch.Generator().manual_seed(splits * 100 + head_dim)
    md = _step(block_size, num_blocks=40, gen=gen, step=LONG_STEP)
    t, hkv = md.num_actual_tokens, 2
    q = torch.randn(t, hkv * gqa, head_dim, generator=gen)
    k = torch.randn(t, hkv, head_dim, generator=gen)
    v = torch.randn(t, hkv, head_dim, generator=gen)
    cache = torch.randn(TorchPagedAttention.kv_cache_shape(40, block_size, hkv, head_dim), generator=gen)
    layer = SimpleNamespace(num_kv_heads=hkv, head_dim=head_dim, scale=head_dim ** -0.5, sliding_window=window)
    ref_cache = cache.clone()
    want = TorchPagedAttention().forward(layer, q, k, v, ref_cache, TorchPagedAttention().build_metadata(md))
    got, tri_cache = _run_triton(layer, q, k, v, cache, md, splits=splits)
    torch.testing.assert_close(tri_cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_split_choice_depends_on_the_step_shape_only():
    backend = TritonPagedAttention()
    gpu = torch.device("cuda")  # (only its type is read)
    assert backend.kv_splits(1, 8, gpu) == 16 and backend.kv_splits(4, 8, gpu) == 8
    assert backend.kv_splits(256, 8, gpu) == 1 and backend.kv_splits(2, 1, torch.device("cpu")) == 1
    assert TritonPagedAttention(4).kv_splits(1000, 8, gpu) == 4
    with pytest.raises(ValueError, match="power of two"):
        TritonPagedAttention(3)
