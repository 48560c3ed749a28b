"""float16 / bfloat16 checkpoints under the float32 default: every linear keeps the checkpoint's 16 bits as GEMV
tiles (no float32 copy), the embedding its table as stored, and greedy tokens equal HF transformers float32 on the
same checkpoint (its weights widened, which is exact), with the decoder graph and without; GGUF F16 / BF16 files
the same; and loading one costs about the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagemill import LLM, SamplingParams
from pagemill.layers.linear import LinearBase
from pagemill.layers.quantization.gguf_report import weight_format_table
from pagemill.layers.quantization.half_tiles import HalfTilesLinearMethod
from pagemill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tests.conftest import SMOL_PROMPTS, default_model_path, hf_greedy, requires_kernels
from tests.layers.helpers import engine_model
from tests.models.gguf_rewrite import to_float_gguf
from tests.models.hf_reference import hf_greedy_cached

pytestmark = [requires_kernels, pytest.mark.slow]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
KINDS = ["llama", "qwen3", "gemma3_text", "phi3"]  # untied; tied with QK norms; tied, sandwich norms; fused qkv


@pytest.fixture(scope="module")
def half_models(tiny_models, tmp_path_factory) -> dict[tuple[str, str], str]:
    """The tiny random families saved in float16 and bfloat16 (save_pretrained of the cast model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("half")
    paths = {}
    for kind in KINDS:
        model = AutoModelForCausalLM.from_pretrained(tiny_models[kind], dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(tiny_models[kind])
        for name, dtype in DTYPES.items():
            path = root / f"{kind}-{name}"
            model.to(dtype).save_pretrained(path)
            tok.save_pretrained(path)
            paths[kind, name] = str(path)
    return paths


def _check_16_bit(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every linear (the LM head included) is 16-bit tiles of `dtype`; the embedding keeps its 16-bit table."""
    kind = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    linears = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
    assert linears and all(isinstance(m.quant_method, HalfTilesLinearMethod) for m in linears)
    assert {m.quant_method.records for m in linears} == {kind}
    assert all(m.weight is None for m in linears)  # no float32 copy
    (embedding,) = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    assert embedding.weight is None and embedding.half_table.dtype == dtype


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_16_bit_checkpoint_matches_hf_float32(kind, dtype, half_models, smol_hf):
    from transformers import AutoModelForCausalLM

    path = half_models[kind, dtype]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [smol_hf[1].encode(p) for p in SMOL_PROMPTS[:6]]
    want = [hf_greedy(hf, p, 24) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for eager in (False, True) if kind == "llama" else (False,):  # the decoder graph, then module by module
        llm = LLM(path, kv_cache_memory="64MiB", block_size=8, enforce_eager=eager)
        _check_16_bit(engine_model(llm), DTYPES[dtype])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, (kind, dtype, eager)


def test_batch_invariant_16_bit_rows_do_not_depend_on_the_batch(half_models):
    """batch_invariant=True runs the tiles' direct path: a prompt's logprobs alone equal those within a batch."""
    llm = LLM(half_models["llama", "bfloat16"], kv_cache_memory="64MiB", batch_invariant=True)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    prompts = ["The capital of France is", "1 2 3 4", "Once upon a time there was a", "hello"]
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    batched = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == batched.token_ids
    assert [list(p.values()) for p in alone.logprobs] == [list(p.values()) for p in batched.logprobs]


@pytest.mark.parametrize("ggml_type", [1, 30])  # F16, BF16
def test_float_gguf_is_16_bit_tiles_and_greedy_equals_hf(ggml_type, tmp_path):
    """SmolLM2 with every 2-D weight (its tied embedding too) in F16 / BF16: 16-bit records throughout, the head screen
    from the 16-bit table, and HF transformers' float32 tokens on the same file."""
    path = str(tmp_path / "smollm2-16.gguf")
    to_float_gguf(default_model_path(), path, ggml_type)
    ref = hf_greedy_cached(path, SMOL_PROMPTS, 32)
    llm = LLM(path, max_model_len=512, kv_cache_memory="64MiB")
    dtype = torch.float16 if ggml_type == 1 else torch.bfloat16
    _check_16_bit(engine_model(llm), dtype)
    assert {r.path for r in weight_format_table(engine_model(llm))} == {f"{'f16' if ggml_type == 1 else 'bf16'} records"}
    runner = llm.llm_engine.engine_core.executor.model_runner
    assert runner.head_screen is not None
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in ref], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r["output_token_ids"] for r in ref]
    # Plain greedy rows take the head screen: HF's tokens up to the first EOS (where HF's min_new_tokens differs)
    eos = llm.get_tokenizer().eos_token_id
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in ref],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for o, r in zip(outs, ref):
        got = list(o.outputs[0].token_ids)
        n = got.index(eos) if eos in got else len(got)
        assert got[:n] == r["output_token_ids"][:n]
    assert runner.head_screen.rows > 0


_RSS_SCRIPT = """
import json, sys
def peak_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
import torch, transformers, tokenizers  # the runtime's own memory, before any model
from pagemill import LLM, SamplingParams
base = peak_mb()
llm = LLM(sys.argv[1], kv_cache_memory="32MiB", max_model_len=256)
llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print(json.dumps({"base_mb": base, "peak_mb": peak_mb()}))
"""


def test_loading_a_16_bit_checkpoint_costs_about_the_file(tmp_path):
    """Peak resident memory of loading and running a bfloat16 safetensors checkpoint of ~200 MB, in a fresh process,
    over the runtime's own: at most 1.25x the file + the KV cache + 300 MB (a float32 copy alone is 2x the file)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagemill.benchmarks.model_path import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=768, intermediate_size=3072, num_hidden_layers=6,
                         num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    file_mb = os.path.getsize(tmp_path / "model.safetensors") / 2**20
    assert file_mb > 150
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["peak_mb"] - result["base_mb"] <= 1.25 * file_mb + 32 + 300, (result, file_mb)
