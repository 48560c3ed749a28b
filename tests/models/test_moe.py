"""MoE: the fused experts against a plain per-expert loop, expert weight loading, and Mixtral / Qwen2-MoE / Qwen3-MoE
greedy outputs equal to HF transformers in a batch, with chunked prefill and under preemption."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill import LLM, SamplingParams
from pagemill.kernels.ops import TorchLayerOps
from pagemill.layers.fused_moe import FusedMoE, expert_target, fused_experts, select_experts, split_stacked_experts
from pagemill.models.decoder import DecoderForCausalLM, DecoderSpec
from pagemill.models.moe import MoESpec, SparseMoeBlock
from pagemill.models.qwen2_moe import Qwen2MoeForCausalLM
from pagemill.models.weights import load_checkpoint_weights
from tests.conftest import SMOL_PROMPTS, hf_greedy
from tests.layers.helpers import layer_context

MOE_KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _loop_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, top_k: int,
                    renormalize: bool) -> torch.Tensor:
    """HF's eager experts: every expert in turn over the tokens that picked it, added into the output."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, rank = torch.where(ids == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, rank, None]
        out.index_add_(0, token, y)
    return out


@pytest.mark.parametrize("grouped_mm", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 3, 257])
@pytest.mark.parametrize("top_k,renormalize", [(2, True), (2, False), (3, True)])
def test_fused_experts_match_per_expert_loop(num_tokens, top_k, renormalize, grouped_mm):
    torch.manual_seed(num_tokens * 10 + top_k)
    experts, hidden, inter = 8, 64, 48
    x = torch.randn(num_tokens, hidden)
    w13 = torch.randn(experts, 2 * inter, hidden) * 0.1
    w2 = torch.randn(experts, hidden, inter) * 0.1
    logits = torch.randn(num_tokens, experts)
    logits[:, [2, 5]] = -1e4  # experts 2 and 5 get no token
    weights, ids = select_experts(logits, top_k, renormalize)
    assert not torch.isin(ids, torch.tensor([2, 5])).any()
    got = fused_experts(x, w13, w2, weights, ids, TorchLayerOps().silu_and_mul, grouped_mm=grouped_mm)
    ref = _loop_reference(x, w13, w2, logits, top_k, renormalize)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_select_experts_routing():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))


def _fused_moe(num_experts: int, hidden: int, inter: int, proj_names: tuple[str, str, str]) -> FusedMoE:
    return FusedMoE(num_experts, 2, hidden, inter, True, layer_context(kernels=False), proj_names=proj_names)


def test_per_expert_and_stacked_checkpoints_load_the_same():
    torch.manual_seed(0)
    experts, hidden, inter = 4, 16, 8
    gate_up = torch.randn(experts, 2 * inter, hidden)  # transformers 5's in-memory layout
    down = torch.randn(experts, hidden, inter)
    stacked = [("model.layers.0.mlp.experts.gate_up_proj", gate_up), ("model.layers.0.mlp.experts.down_proj", down),
               ("model.layers.0.mlp.gate.weight", torch.zeros(experts, hidden))]
    per_expert = list(split_stacked_experts(stacked, ("w1", "w3", "w2")))
    assert len(per_expert) == 3 * experts + 1 and per_expert[-1][0] == "model.layers.0.mlp.gate.weight"
    layer = _fused_moe(experts, hidden, inter, ("w1", "w3", "w2"))
    loaded = set()
    for name, tensor in per_expert[:-1]:
        target = expert_target(name)
        assert target is not None and target.startswith("model.layers.0.mlp.experts.")
        param = target.rpartition(".")[2]
        layer.load_weight(param, tensor)
        loaded.add((param, None))
    assert loaded == layer.expected_weights()
    assert torch.equal(layer.w13_weight, gate_up) and torch.equal(layer.w2_weight, down)
    assert expert_target("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    with pytest.raises(ValueError, match="no 'w1:4'"):
        layer.load_weight("w1:4", torch.zeros(inter, hidden))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_block_matches_hf(norm_topk_prob):
    """Router, fused experts and the sigmoid-gated shared expert, loaded from HF's own block (stacked experts)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(1)
    config = Qwen2MoeConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                            norm_topk_prob=norm_topk_prob)
    hf = Qwen2MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.2)
    moe = Qwen2MoeForCausalLM.moe_spec(config)
    assert moe.renormalize == norm_topk_prob and moe.sparse_layers == (True, True)
    block = SparseMoeBlock(DecoderSpec.from_hf_config(config), moe, layer_context(kernels=False), "mlp",
                           ("gate_proj", "up_proj", "down_proj"))
    weights = [(f"mlp.{name}", t.detach()) for name, t in hf.state_dict().items()]
    assert "mlp.experts.gate_up_proj" in dict(weights)  # transformers 5 keeps the experts stacked
    root = torch.nn.Module()
    root.mlp = block
    load_checkpoint_weights(root, split_stacked_experts(weights, ("gate_proj", "up_proj", "down_proj")),
                            DecoderForCausalLM.packed_modules_mapping, lambda name: [expert_target(name) or name])
    x = torch.randn(40, 64)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), hf(x.unsqueeze(0)).squeeze(0), rtol=1e-5, atol=1e-5)


def test_qwen_sparse_layers():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4)
    assert MoESpec.qwen_sparse_layers(config) == (False, True, False, False, False, True)


def _prompts(tok) -> list[list[int]]:
    """8 prompts of 5 to about 60 tokens."""
    texts = [" ".join(SMOL_PROMPTS[(i + j) % len(SMOL_PROMPTS)] for j in range(1 + (i * 5) % 7)) for i in range(8)]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def moe_reference(tiny_moe_models, smol_hf) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """kind -> (prompts, HF greedy continuations)."""
    from transformers import AutoModelForCausalLM

    prompts = _prompts(smol_hf[1])
    out = {}
    for kind, path in tiny_moe_models.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[kind] = (prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts])
    return out


# every path must give the same tokens: one batch, chunked prefill, preemption (few KV blocks)
ENGINE_PATHS = {
    "batch": dict(kv_cache_memory="64MiB", block_size=8),
    "chunked_prefill": dict(kv_cache_memory="64MiB", block_size=8, max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=12, block_size=8, max_model_len=80, enable_prefix_caching=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", list(ENGINE_PATHS))
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_tiny_moe_models_match_hf(kind, path, tiny_moe_models, moe_reference):
    prompts, reference = moe_reference[kind]
    llm = LLM(tiny_moe_models[kind], **ENGINE_PATHS[path])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for i, (o, ref) in enumerate(zip(outs, reference)):
        assert o.outputs[0].token_ids == ref, f"{kind} / {path}: prompt {i}"
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    if path == "preemption":
        assert stats.num_preemptions > 0
