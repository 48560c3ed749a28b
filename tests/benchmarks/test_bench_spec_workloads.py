"""The request sets of `bench speculative`: edit (high overlap), ShareGPT-like, and Python code completion."""

from __future__ import annotations

import pytest

from pagemill.benchmarks import spec_workloads as W


def test_edit_prompts_ask_to_repeat_or_edit_a_corpus_paragraph(tokenizer):
    paragraphs = W.corpus_paragraphs()
    assert len(paragraphs) == 6 and paragraphs[1].startswith("Call me Ishmael.")
    messages = W.edit_messages(30)
    pairs = {(m[0]["content"].split("\n\n")[0], m[0]["content"].split("\n\n")[1]) for m in messages}
    assert len(pairs) == 30  # 5 instructions x 6 paragraphs: no prompt repeats before 30
    assert all(m[0]["role"] == "user" and m[0]["content"].split("\n\n")[1] in paragraphs for m in messages)
    assert messages[0][0]["content"].startswith("Repeat the following text exactly")
    prompts = W.edit_prompts(tokenizer, 3)
    text = tokenizer.decode(prompts[0])
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")  # chat template
    assert paragraphs[0] in text and W.EDIT_INSTRUCTIONS[0] in text


def test_sharegpt_prompts_reuse_the_sharegpt_dataset(tokenizer):
    prompts = W.sharegpt_prompts(tokenizer, 8, output_len=32, seed=0)
    assert prompts == W.sharegpt_prompts(tokenizer, 8, output_len=32, seed=0)  # seeded
    assert len(prompts) == 8 and len({tuple(p) for p in prompts}) == 8
    assert all(4 <= len(p) <= 1024 for p in prompts) and len({len(p) for p in prompts}) > 1  # drawn lengths


def test_code_prompts_are_the_start_of_stdlib_modules(tokenizer):
    prompts = W.code_prompts(tokenizer, len(W.CODE_MODULES) + 1, prompt_len=200)
    for k, ids in enumerate(prompts[:len(W.CODE_MODULES)]):
        text = tokenizer.decode(ids)
        source = W.python_source(W.CODE_MODULES[k])
        assert source.startswith(text) and text.endswith("\n")  # a prefix of the real file, whole lines
        assert 150 <= len(ids) <= 200
    assert len(prompts[-1]) > len(prompts[0])  # second pass: same module, a later cut
    assert W.python_source(W.CODE_MODULES[0]).startswith(tokenizer.decode(prompts[-1]))


def test_build_workload_dispatch(tokenizer):
    assert W.build_workload("edit", tokenizer, 2, 16) == W.edit_prompts(tokenizer, 2)
    assert W.build_workload("code", tokenizer, 2, 16, code_prompt_len=100) == W.code_prompts(tokenizer, 2, 100)
    with pytest.raises(ValueError, match="unknown workload"):
        W.build_workload("poetry", tokenizer, 2, 16)
