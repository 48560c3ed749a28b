"""Shared fixtures: the embedded SmolLM2 model, its HF transformers twin, tiny random HF models."""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch

from pagemill.loader.default_model import default_model_path

if TYPE_CHECKING:
    from pagemill.kernels.ops import KernelLayerOps


def pytest_configure(config: pytest.Config) -> None:
    """The run's laid-out records go to a directory of its own (removed at the end), not the user's cache: test
    models live in temporary paths, so their records would only pile up there."""
    if "PAGEMILL_RECORDS_CACHE_DIR" not in os.environ:
        config._records_dir = tempfile.mkdtemp(prefix="pagemill-test-records-")
        os.environ["PAGEMILL_RECORDS_CACHE_DIR"] = config._records_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the run's records directory (after its background writes)."""
    records_dir = getattr(config, "_records_dir", None)
    if records_dir is not None:
        from pagemill.layers.quantization.records_cache import wait_for_writes

        wait_for_writes()
        shutil.rmtree(records_dir, ignore_errors=True)
        os.environ.pop("PAGEMILL_RECORDS_CACHE_DIR", None)


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "In 1492, Christopher Columbus",
    "The quick brown fox",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The largest planet in our solar system is",
    "import numpy as np\nx = np.arange(10)\n",
    "Dear Sir or Madam, I am writing to",
]


def cxx_compiler() -> str | None:
    """The C++ compiler `python -m pagemill.kernels.build` uses ($CXX, else c++), if one is installed."""
    cxx = shlex.split(os.environ.get("CXX", "c++") or "c++")
    return shutil.which(cxx[0]) if cxx else None


def require_kernels() -> ModuleType:
    """The built CPU kernels; FAILS (with the build error) when missing where a C++ compiler exists, skips only
    where none is installed (a platform that legitimately runs without compiled kernels)."""
    from pagemill.kernels import kernel_info, load_kernels

    kernels = load_kernels()
    if kernels is not None:
        return kernels
    cxx = cxx_compiler()
    if cxx is None:
        pytest.skip("no C++ compiler installed: this platform runs without pagemill's compiled kernels")
    reason = kernel_info()["build_error"] or "they were never built for this source tree"
    pytest.fail(f"pagemill's CPU kernels are missing although a C++ compiler is installed ({cxx}): {reason}. "
                "Build them with `make kernels` (python -m pagemill.kernels.build --strict shows the full error).",
                pytrace=False)


def require_kernel_ops() -> KernelLayerOps:
    """The compiled kernels' layer-ops table (what the quantization methods and layers are given), as
    require_kernels: fails where they should exist, skips where they cannot."""
    from pagemill.kernels.ops import KernelLayerOps

    return KernelLayerOps(require_kernels())


@pytest.fixture
def kernels_required() -> ModuleType:
    """Fixture form of require_kernels (used through the `requires_kernels` mark)."""
    return require_kernels()


# The one rule for kernel tests: `pytestmark = requires_kernels` or `@requires_kernels`.
requires_kernels = pytest.mark.usefixtures("kernels_required")


@pytest.fixture
def shm_comm_required() -> ModuleType:
    """The shared-memory communicator extension (built beside the kernels); fails naming why where a C++ compiler
    exists, skips where none is installed."""
    from pagemill.kernels.build import load_shm_comm

    module, reason = load_shm_comm()
    if module is not None:
        return module
    if cxx_compiler() is None:
        pytest.skip("no C++ compiler installed: the TP ranks use gloo")
    pytest.fail(f"pagemill's shm communicator extension is missing although a C++ compiler is installed: {reason}",
                pytrace=False)


requires_shm_comm = pytest.mark.usefixtures("shm_comm_required")


def kernel_isas() -> list[str]:
    """Kernel variants to test: the forced one (PAGEMILL_CPU_ISA), else every one this CPU runs; [] if not built."""
    from pagemill.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        return []
    forced = os.environ.get("PAGEMILL_CPU_ISA", "").strip().lower()
    return [kernels.isa()] if forced not in ("", "auto") else list(kernels.supported_isas())


@pytest.fixture(params=kernel_isas() or ["unbuilt"])
def kernel_isa(request):
    """Runs the test once per kernel variant (the variant active meanwhile); once with no kernels if unbuilt."""
    from pagemill.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        yield None
        return
    previous = kernels.isa()
    kernels.set_isa(request.param)
    try:
        yield request.param
    finally:
        kernels.set_isa(previous)


@pytest.fixture(scope="session")
def smol_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF."""
    return default_model_path()


@pytest.fixture(scope="session")
def smol_llm(smol_path):
    """A pagemill LLM on SmolLM2 (float32), shared by the tests that only read from it."""
    from pagemill import LLM

    return LLM(smol_path, kv_cache_memory="512MiB", max_model_len=2048)


@pytest.fixture(scope="session")
def smol_hf(smol_path):
    """HF transformers' model and tokenizer for the same GGUF, dequantized to float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(smol_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, tok


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """HF transformers greedy continuation of one prompt (no padding, so exact float32 numerics)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _save_tiny(kind: str, root: str, tokenizer) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.2, tie_word_embeddings=False)
    extra = {"llama": dict(rope_theta=10000.0), "qwen2": dict(rope_theta=1e6),
             "mistral": dict(sliding_window=None, rope_theta=1e4),
             "qwen3": dict(rope_theta=1e6, head_dim=32, tie_word_embeddings=True),
             "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True,
                                 layer_types=["sliding_attention", "full_attention"]),
             "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                          pad_token_id=0),
             # MoE: 8 experts, top-2; Qwen2-MoE's layer 0 dense (mlp_only_layers), layer 1 with its shared expert
             "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None, rope_theta=1e6),
             "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[0],
                               rope_theta=1e6),
             "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                               head_dim=32, rope_theta=1e6)}[kind]
    config = AutoConfig.for_model(kind, **{**common, **extra})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = os.path.join(root, f"tiny-{kind}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smol_hf) -> dict[str, str]:
    """Tiny random Llama, Qwen2, Mistral, Qwen3, Gemma 3 and Phi-3 models saved with save_pretrained (SmolLM2's tokenizer)."""
    root = str(tmp_path_factory.mktemp("tiny"))
    return {k: _save_tiny(k, root, smol_hf[1]) for k in ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "phi3")}


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory, smol_hf) -> dict[str, str]:
    """Tiny random Mixtral, Qwen2-MoE and Qwen3-MoE models saved with save_pretrained (SmolLM2's tokenizer)."""
    root = str(tmp_path_factory.mktemp("tiny_moe"))
    return {k: _save_tiny(k, root, smol_hf[1]) for k in ("mixtral", "qwen2_moe", "qwen3_moe")}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers, 2 KV heads of 8 dims) with SmolLM2's tokenizer, without loading SmolLM2's
    weights: for engine and server tests that need a model but not its numerics."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagemill.benchmarks.model_path import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(default_model_path())
    torch.manual_seed(0)
    # initializer_range 0.2: logits far apart, so greedy tokens do not hang on rounding
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
