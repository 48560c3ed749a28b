"""Sampling features on the real model: logprobs vs HF, seeds, penalties, stops, n, min_tokens."""

from __future__ import annotations

import pytest
import torch

from pagemill import SamplingParams
from tests.conftest import SMOL_PROMPTS


def _ids(smol_hf, text: str) -> list[int]:
    return smol_hf[1].encode(text)


def test_top_logprobs_match_hf_log_softmax(smol_llm, smol_hf):
    model = smol_hf[0]
    for text in SMOL_PROMPTS[:3]:
        prompt = _ids(smol_hf, text)
        out = smol_llm.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3,
                                               ignore_eos=True), use_tqdm=False)[0]
        toks = out.outputs[0].token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + toks])).logits[0].float()
        ref = logits.log_softmax(-1)
        for i, (tok, lp) in enumerate(zip(toks, out.outputs[0].logprobs)):
            row = ref[len(prompt) - 1 + i]
            top_vals, top_ids = row.topk(5)
            assert lp[tok].logprob == pytest.approx(row[tok].item(), abs=1e-3)
            assert lp[tok].rank == 1
            for r, (v, t) in enumerate(zip(top_vals.tolist(), top_ids.tolist()), start=1):
                assert lp[t].logprob == pytest.approx(v, abs=1e-3)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            d = out.prompt_logprobs[pos]
            assert d[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-3)
            assert len(d) >= 3
        assert out.outputs[0].cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in
                                                                       zip(out.outputs[0].logprobs, toks)), abs=1e-4)


def test_seeded_sampling_is_reproducible_whatever_the_batch(smol_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    alone = smol_llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=30) for _ in range(7)]
    batch = smol_llm.generate(["Water boils at"] * 3 + ["Once upon a time"] + ["The quick brown fox"] * 5,
                              others[:3] + [sp] + others[3:] + [SamplingParams(temperature=0)], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    other_seed = smol_llm.generate("Once upon a time", SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99,
                                                                     max_tokens=24), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone


def test_repetition_penalty_matches_hf(smol_llm, smol_hf):
    model, tok = smol_hf
    prompt = _ids(smol_hf, "The list of numbers: one, two, three, one, two, three,")
    out = smol_llm.generate({"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                             repetition_penalty=1.3, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref


def test_frequency_and_presence_penalties_change_greedy_text(smol_llm):
    base = smol_llm.generate("one two three one two three one two", SamplingParams(temperature=0, max_tokens=20),
                             use_tqdm=False)[0].outputs[0].token_ids
    pen = smol_llm.generate("one two three one two three one two",
                            SamplingParams(temperature=0, max_tokens=20, frequency_penalty=2.0, presence_penalty=2.0),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert pen != base
    assert max(pen.count(t) for t in set(pen)) <= max(base.count(t) for t in set(base))


def test_stop_string_truncates_text(smol_llm):
    full = smol_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=40),
                             use_tqdm=False)[0].outputs[0]
    stop = full.text[10:16]
    out = smol_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = smol_llm.generate("The capital of France is",
                             SamplingParams(temperature=0, max_tokens=40, stop=stop, include_stop_str_in_output=True),
                             use_tqdm=False)[0].outputs[0]
    assert incl.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_length(smol_llm):
    full = smol_llm.generate("Water boils at", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_id = full.token_ids[5]
    out = smol_llm.generate("Water boils at", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_holds_back_eos(smol_llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    short = smol_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = smol_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=60, min_tokens=20), use_tqdm=False)[0]
    assert len(longer.outputs[0].token_ids) >= 20


def test_chat_uses_the_shared_renderer(smol_llm):
    from pagemill.entrypoints.chat_utils import ChatRenderer, ChatTemplateError

    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! I"}]
    ids = smol_llm.render_chat(msgs, continue_final_message=True)
    assert ids == ChatRenderer(smol_llm.get_tokenizer()).render(msgs, continue_final_message=True)
    assert smol_llm.get_tokenizer().decode(ids).endswith("<|im_start|>assistant\nHello! I")
    with pytest.raises(ChatTemplateError, match="continue_final_message"):  # the server's checks apply offline
        smol_llm.chat(msgs[:1], continue_final_message=True, use_tqdm=False)


def test_n_samples(smol_llm):
    out = smol_llm.generate("Once upon a time", SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=16),
                            use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    assert out[0].finished


@pytest.mark.parametrize("prompt,params,field", [
    ("", SamplingParams(), "prompt"),
    ("hi", None, "max_tokens"),
    ("hi", None, "temperature"),
    ("hi", None, "top_p"),
    ("x " * 3000, SamplingParams(), "max_model_len"),
])
def test_bad_input_raises_before_scheduling(smol_llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        if params is None:
            params = {"max_tokens": lambda: SamplingParams(max_tokens=0),
                      "temperature": lambda: SamplingParams(temperature=-1.0),
                      "top_p": lambda: SamplingParams(top_p=1.5)}[field]()
        smol_llm.generate(["a fine prompt", prompt], params, use_tqdm=False)
    assert not smol_llm.llm_engine.has_unfinished_requests()


def test_unknown_model_path_is_a_clear_error():
    from pagemill import LLM

    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_incremental_detokenizer_handles_multibyte(smol_hf):
    from pagemill.engine.detokenizer import IncrementalDetokenizer

    tok = smol_hf[1]
    text = " Héllo wörld, 世界 🙂🚀 — naïve café ∑∫ ok"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(detok.step(t) for t in ids) == tok.decode(ids)


def test_parallel_sampling_shares_prompt_blocks_with_copy_on_write(smol_path):
    from pagemill import LLM

    llm = LLM(smol_path, block_size=8, kv_cache_memory="128MiB", max_model_len=1024, enable_prefix_caching=False)
    prompt = "The quick brown fox jumps over the lazy dog. The"  # not a multiple of 8 tokens
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    single = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    before = llm.get_stats().num_cow_copies
    multi = llm.generate(prompt, greedy.clone(n=3), use_tqdm=False)[0]
    assert [c.token_ids for c in multi.outputs] == [single] * 3  # shared blocks were copied before writes
    assert llm.get_stats().num_cow_copies > before
    seeded = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=10, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0]
    for i in range(3):
        one = llm.generate(prompt, SamplingParams(temperature=1.0, seed=10 + i, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0]
        assert seeded.outputs[i].token_ids == one.outputs[0].token_ids
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def test_best_of_returns_the_most_likely_of_more_samples(smol_llm):
    sp = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    out = smol_llm.generate("Once upon a time", sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1] and out.outputs[0].logprobs is None
    scored = smol_llm.generate("Once upon a time", SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=12,
                                                                  ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    best = sorted(scored.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]


def test_default_max_tokens_is_per_prompt_and_leaves_params_untouched(smol_llm):
    processor = smol_llm.llm_engine.processor
    shared = SamplingParams(max_tokens=None)
    _, short = processor.process("s", "Hi", shared)
    _, long = processor.process("l", "Hi there, a somewhat longer prompt", shared)
    max_len = processor.model_config.max_model_len
    assert short.sampling_params.max_tokens == max_len - len(short.prompt_token_ids)
    assert long.sampling_params.max_tokens == max_len - len(long.prompt_token_ids)
    assert shared.max_tokens is None


def test_logprob_token_ids_give_those_tokens_logprobs_and_ranks(smol_llm, smol_hf):
    prompt = _ids(smol_hf, SMOL_PROMPTS[0])
    wanted = [5, 1000, 20000]
    out = smol_llm.generate({"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=4, logprobs=2, logprob_token_ids=wanted,
                                           ignore_eos=True), use_tqdm=False)[0]
    toks = out.outputs[0].token_ids
    with torch.inference_mode():
        ref = smol_hf[0](torch.tensor([prompt + toks])).logits[0].float().log_softmax(-1)
    for i, position in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + i]
        assert len(position) <= 1 + 2 + len(wanted)
        for t in wanted:
            assert position[t].logprob == pytest.approx(row[t].item(), abs=1e-3)
            assert position[t].rank == pytest.approx(int((row > row[t]).sum()) + 1, abs=2)  # near-ties may swap
