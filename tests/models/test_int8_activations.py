"""linear_dtype="int8" end to end: the records methods take int8 activations, the engine runs every row count on
them (chunked prefill, batched decode), stays close to the exact path, and bad combinations name the field."""

from __future__ import annotations

import pytest
import torch

from pagemill import LLM, SamplingParams
from pagemill.benchmarks.quant_accuracy import compare, corpus_paragraphs, corpus_tokenizer, prompt_topk
from pagemill.kernels.ops import TorchLayerOps
from pagemill.layers.quantization import get_quant_config
from tests.conftest import SMOL_PROMPTS, require_kernel_ops, requires_kernels

pytestmark = requires_kernels


def test_records_methods_take_int8_activations():
    """GGUF records and weight-only layers get int8 activations; the LM head of weight-only stays float."""
    from pagemill.layers.quantization.gguf import GGUFQuantConfig

    ops = require_kernel_ops()
    gguf = get_quant_config("int8", "gguf", torch.float32, ops, gguf_tensor_types={"a.weight": 12})
    assert isinstance(gguf, GGUFQuantConfig)
    assert gguf.get_linear_method(["a.weight"], 256).int8_activations  # Q4_K
    assert not get_quant_config("auto", "gguf", torch.float32, ops,
                                gguf_tensor_types={"a.weight": 12}).get_linear_method(["a.weight"], 256).int8_activations
    weight_only = get_quant_config("int8", "int4", torch.float32, ops)
    assert weight_only.get_linear_method(["model.layers.0.mlp.down_proj.weight"], 64).int8_activations
    assert not hasattr(weight_only.get_linear_method(["lm_head.weight"], 64), "int8_activations")


def test_float_checkpoint_or_no_kernels_is_refused():
    with pytest.raises(ValueError, match="linear_dtype='int8'.*quantization='none'"):
        get_quant_config("int8", "none", torch.float32, require_kernel_ops())
    with pytest.raises(ValueError, match="linear_dtype='int8'.*no kernels"):
        get_quant_config("int8", "gguf", torch.float32, TorchLayerOps())


def test_smollm2_close_to_the_exact_path(smol_path):
    """Teacher-forced over three corpus paragraphs (prefill chunks of 64 rows): top-1 agreement >= 0.85 (0.93 over
    the whole corpus); and a batch of prompts decodes (batched GEMV rows) to non-empty text."""
    tok = corpus_tokenizer(smol_path)
    tokens = [tok.encode(p) for p in corpus_paragraphs()[:3]]
    ref = prompt_topk(smol_path, tokens)
    got = compare("int8", ref, prompt_topk(smol_path, tokens, linear_dtype="int8"))
    assert got.top1_agreement >= 0.85, got
    assert 0 < got.mean_abs_dlogprob < 0.2, got
    llm = LLM(smol_path, linear_dtype="int8", max_model_len=512, kv_cache_memory="256MiB")
    outs = llm.generate(SMOL_PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
