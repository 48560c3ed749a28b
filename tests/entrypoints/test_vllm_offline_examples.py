"""vLLM's offline example scripts (vllm 0.33.0 sdist: examples/basic/offline_inference/{basic,chat,generate}.py,
features/automatic_prefix_caching/prefix_caching_offline.py, features/reset_kv/reset_kv_offline.py,
deployment/llm_engine_example.py) written out here with `vllm` -> `pagemill` and the embedded model: the names and
call shapes they use work unchanged."""

from __future__ import annotations

import pytest

from pagemill import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams
from pagemill.distributed import cleanup_dist_env_and_memory
from pagemill.outputs import RequestOutput as OutputsRequestOutput
from pagemill.utils.argparse_utils import FlexibleArgumentParser

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]


def test_basic() -> None:
    llm = LLM()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95))
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(len(o.outputs[0].token_ids) == 16 and o.outputs[0].text for o in outputs)  # vLLM's max_tokens=16


def _example_parser() -> FlexibleArgumentParser:
    """generate.py / chat.py's create_parser()."""
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)  # the examples name a hub model; the embedded one here
    group = parser.add_argument_group("Sampling parameters")
    group.add_argument("--max-tokens", type=int)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    return parser


@pytest.mark.parametrize("example", ["generate", "chat"])
def test_generate_and_chat(example: str) -> None:
    parser = _example_parser()
    if example == "chat":
        parser.add_argument("--chat-template-path", type=str)
    args: dict = vars(parser.parse_args(["--max_tokens", "8", "--temperature=0", "--kv-cache-memory", "256MiB",
                                         "--max_model_len", "1024"]))
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    top_p, top_k = args.pop("top_p"), args.pop("top_k")
    args.pop("chat_template_path", None)
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    assert isinstance(sampling_params, SamplingParams)
    sampling_params.max_tokens = max_tokens
    sampling_params.temperature = temperature
    assert top_p is None and top_k is None
    if example == "generate":
        outputs = llm.generate(PROMPTS, sampling_params)
        assert len(outputs) == 4 and all(len(o.outputs[0].token_ids) == 8 for o in outputs)
        return
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hello! How can I assist you today?"},
                    {"role": "user", "content": "Write an essay about the importance of higher education."}]
    outputs: list[OutputsRequestOutput] = llm.chat(conversation, sampling_params, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].outputs[0].text
    outputs = llm.chat([conversation for _ in range(3)], sampling_params, use_tqdm=True)
    assert len({o.outputs[0].text for o in outputs}) == 1  # greedy: the same answer three times


def test_prefix_caching_offline() -> None:
    prefix = ("You are an expert school principal, skilled in effectively managing faculty and staff. Draft 10-15 "
              "questions for a potential first grade Head Teacher. Based on these information, fulfill the "
              "following paragraph: ")
    prompts = [prefix + p for p in PROMPTS]
    sampling_params = SamplingParams(temperature=0.0)
    regular_llm = LLM(gpu_memory_utilization=0.4)
    regular = [o.outputs[0].text for o in regular_llm.generate(prompts, sampling_params)]
    del regular_llm
    cleanup_dist_env_and_memory()
    cached_llm = LLM(enable_prefix_caching=True, gpu_memory_utilization=0.4)
    cached_llm.generate(prompts[0], sampling_params)
    outputs = cached_llm.generate(prompts, sampling_params)
    assert [o.outputs[0].text for o in outputs] == regular
    assert all(o.num_cached_tokens > 0 for o in outputs)


def _test_prompts() -> list[tuple[str, SamplingParams]]:
    """reset_kv_offline.py / llm_engine_example.py's create_test_prompts() (shorter outputs)."""
    return [("A robot may not injure a human being " * 50,
             SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16)),
            ("A robot may not injure a human being " * 50,
             SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16)),
            ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=24)),
            ("What is the meaning of life?",
             SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1, max_tokens=24))]


@pytest.mark.parametrize("reset_at_step", [None, 10])
def test_llm_engine_example_and_reset_kv(reset_at_step: int | None) -> None:
    """llm_engine_example.py (reset_at_step None) and reset_kv_offline.py (resets the prefix cache at step 10 with
    requests running: they are preempted and recomputed, and still finish with the same greedy text)."""
    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--kv-cache-memory", "256MiB", "--max-model-len", "1024"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    test_prompts = _test_prompts()
    finished: dict[str, RequestOutput] = {}
    request_id, step_id = 0, 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        if step_id == reset_at_step:
            assert engine.reset_prefix_cache(reset_running_requests=True)
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                finished[request_output.request_id] = request_output
        step_id += 1
    assert sorted(finished) == ["0", "1", "2", "3"]
    assert finished["0"].outputs[0].text == finished["1"].outputs[0].text
    assert finished["0"].prompt_logprobs[0] is None and len(finished["0"].prompt_logprobs) == len(
        finished["0"].prompt_token_ids)
    assert len(finished["3"].outputs) == 2
    assert engine.get_stats().num_running_reqs == 0


def test_prompt_logprobs_survive_a_preemption_mid_prompt() -> None:
    """Chunked prefill preempted (reset_prefix_cache with running requests) after two chunks: the recompute does
    not repeat the logprobs already reported, nor miss any."""
    prompt = "A robot may not injure a human being or, through inaction, allow a human being to come to harm. " * 8
    params = SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=4)
    reference = LLM(kv_cache_memory="256MiB", max_model_len=1024).generate(prompt, params, use_tqdm=False)[0]
    engine = LLMEngine.from_engine_args(EngineArgs(kv_cache_memory="256MiB", max_model_len=1024,
                                                   max_num_batched_tokens=48))
    engine.add_request("0", prompt, params)
    engine.add_request("1", "To be or not to be,", SamplingParams(max_tokens=8, temperature=0.0))
    outputs, step = {}, 0
    while engine.has_unfinished_requests():
        if step == 2:
            assert engine.reset_prefix_cache(reset_running_requests=True)
        for out in engine.step():
            outputs[out.request_id] = out
        step += 1
    got = outputs["0"]
    assert got.metrics.num_preemptions == 1
    assert got.outputs[0].token_ids == reference.outputs[0].token_ids
    assert len(got.prompt_logprobs) == len(reference.prompt_logprobs) == len(reference.prompt_token_ids)
    for a, b in zip(got.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
