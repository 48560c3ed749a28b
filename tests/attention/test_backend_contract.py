"""The attention-backend contract: batch order asked of the backend, typed metadata, paths chosen from declared
capabilities, and kernel vs reference chosen per engine (two engines side by side in one process)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from pagemill import LLM, SamplingParams
from pagemill.attention.backend import batch_permutation
from pagemill.attention.backends.cpu_paged import CpuAttentionMetadata, CpuPagedAttention
from pagemill.attention.backends.torch_paged import TorchAttentionMetadata, TorchPagedAttention
from pagemill.attention.metadata import CommonAttentionMetadata
from pagemill.kernels.ops import KernelLayerOps, TorchLayerOps
from pagemill.layers.attention import Attention
from pagemill.layers.norm import RMSNorm
from pagemill.layers.rotary import RotaryEmbedding
from tests.conftest import SMOL_PROMPTS, hf_greedy, requires_kernels
from tests.layers.helpers import engine_model, layer_context


def test_batch_permutation_follows_the_backend_order():
    scheduled = np.array([5, 1, 7, 1, 3, 1])
    computed = np.array([0, 9, 4, 2, 0, 0])  # prefill, decode, chunk, decode, prefill, decode (a 1-token prefill)
    assert batch_permutation(scheduled, computed, TorchPagedAttention.batch_order).tolist() == [1, 3, 5, 0, 2, 4]
    assert batch_permutation(scheduled, computed, CpuPagedAttention.batch_order).tolist() == [1, 3, 5, 2, 0, 4]
    assert batch_permutation(scheduled, computed, (2, 1, 0)).tolist() == [0, 4, 2, 1, 3, 5]


def _common() -> CommonAttentionMetadata:
    qsl = np.array([0, 1, 4, 9])
    return CommonAttentionMetadata(3, 1, 9, qsl, np.array([6, 7, 5]), np.array([5, 4, 0]),
                                   np.array([[1, 2], [3, 4], [5, 0]]), 4, torch.arange(9))


@requires_kernels
def test_backends_build_their_own_typed_metadata():
    common = _common()
    md = TorchPagedAttention().build_metadata(common)
    assert type(md) is TorchAttentionMetadata and md.common is common
    cpu = CpuPagedAttention().build_metadata(common)
    assert isinstance(cpu, CpuAttentionMetadata)
    assert (cpu.num_kernel_reqs, cpu.num_kernel_tokens) == (2, 4)  # the decode and the context chunk
    assert cpu.context_lens.tolist() == [5, 4] and cpu.query_start_loc.tolist() == [0, 1, 4]


@requires_kernels
def test_attention_path_follows_declared_capabilities():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    rope = RotaryEmbedding(cfg, 64, torch.float32)
    cpu = layer_context(kernels=True)
    cpu = type(cpu)(cpu.dtype, cpu.max_position, cpu.ops, cpu.quant_config, CpuPagedAttention())
    assert Attention(4, 16, 2, 0.25, cpu, rope, torch.float32).fused
    norms = RMSNorm(16, 1e-6, cpu.ops), RMSNorm(16, 1e-6, cpu.ops)
    assert Attention(4, 16, 2, 0.25, cpu, rope, torch.float32, None, *norms).fused  # the kernel takes the QK norm

    class NoQKNormHook(CpuPagedAttention):
        capabilities = dataclasses.replace(CpuPagedAttention.capabilities, qk_norm_hook=False)

    no_hook = type(cpu)(cpu.dtype, cpu.max_position, cpu.ops, cpu.quant_config, NoQKNormHook())
    assert not Attention(4, 16, 2, 0.25, no_hook, rope, torch.float32, None, *norms).fused
    assert not Attention(4, 16, 2, 0.25, layer_context(kernels=False), rope, torch.float32).fused


@pytest.mark.slow
@requires_kernels
def test_kernel_and_reference_engines_side_by_side(tiny_models, smol_hf):
    """Two engines in one process, one with the kernels and one pure torch, interleaved: each keeps its own
    choice (no process-global switch) and both equal HF token for token."""
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    fast = LLM(path, kv_cache_memory="32MiB", max_model_len=256, block_size=8)
    ref = LLM(path, kv_cache_memory="32MiB", max_model_len=256, block_size=8, attention_backend="torch")
    fast_layer = engine_model(fast).model.layers[0]
    ref_layer = engine_model(ref).model.layers[0]
    assert isinstance(fast_layer.input_layernorm.ops, KernelLayerOps) and fast_layer.self_attn.attn.fused
    assert type(ref_layer.input_layernorm.ops) is TorchLayerOps and not ref_layer.self_attn.attn.fused
    tok = smol_hf[1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in SMOL_PROMPTS[:3]:
        ids = tok.encode(prompt)
        expected = hf_greedy(hf, ids, 12)
        for llm in (fast, ref, fast):
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            assert out[0].outputs[0].token_ids == expected
