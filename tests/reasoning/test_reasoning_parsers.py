"""Reasoning parsers on scripted replies: the whole-reply split (vLLM's semantics), and the streamed deltas of every
split of the reply into two and three chunks adding up to exactly that split; the engine's token gate."""

from __future__ import annotations

import itertools

import pytest

from pagemill.reasoning import (ReasoningGate, ReasoningStreamer, ReasoningTokens, get_reasoning_parser,
                                reasoning_parser_names)

# (parser, prompt state, reply, expected (reasoning, content) with None for an empty part)
CASES = [
    ("deepseek_r1", None, "<think>Let me see.</think>The answer is 4.", ("Let me see.", "The answer is 4.")),
    ("deepseek_r1", None, "Let me see.</think>\n\nThe answer is 4.", ("Let me see.", "\n\nThe answer is 4.")),
    ("deepseek_r1", None, "Still thinking < / think", ("Still thinking < / think", None)),
    ("deepseek_r1", None, "<think></think>4", (None, "4")),
    ("deepseek_r1", False, "The answer is 4.", (None, "The answer is 4.")),
    ("deepseek_r1", True, "a</thin</think>b</think>c", ("a</thin", "b</think>c")),
    ("qwen3", None, "<think>\nhmm\n</think>\n\nHi!", ("\nhmm\n", "\n\nHi!")),
    ("qwen3", None, "Hi, no thinking here.", (None, "Hi, no thinking here.")),
    ("qwen3", None, "<thin", (None, "<thin")),
    ("qwen3", True, "hmm</think>Hi", ("hmm", "Hi")),
    ("qwen3", False, "Hi</think>", (None, "Hi</think>")),
    ("granite", None, "Here is my thought process: two and two. Here is my response: 4",
     (" two and two. ", " 4")),
    ("granite", None, "Here's my thought process:x Here's my response:y", ("x ", "y")),
    ("granite", None, "Just 4.", (None, "Just 4.")),
    ("kimi_k2", None, "a</think>b", ("a", "b")),
]


def streamed(parser, prompt_state, chunks):
    s = ReasoningStreamer(parser, prompt_state)
    reasoning = content = ""
    for i, chunk in enumerate(chunks):
        text = "".join(chunks[:i + 1])
        r, c = s.update(text, final=i == len(chunks) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


def test_registry_has_vllms_names():
    assert {"deepseek_r1", "qwen3", "granite"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("name,state,reply,expected", CASES)
def test_whole_reply(name, state, reply, expected):
    parser = get_reasoning_parser(name)
    r, c = parser.split(reply, True, state)
    assert (r or None, c or None) == expected
    if state is None:
        assert parser.extract_reasoning(reply) == expected


@pytest.mark.parametrize("name,state,reply,expected", CASES)
def test_every_chunk_boundary(name, state, reply, expected):
    parser = get_reasoning_parser(name)
    n = len(reply)
    for i in range(n + 1):
        assert streamed(parser, state, [reply[:i], reply[i:]]) == expected, i
    for i, j in itertools.combinations(range(n + 1), 2):
        assert streamed(parser, state, [reply[:i], reply[i:j], reply[j:]]) == expected, (i, j)
    assert streamed(parser, state, list(reply)) == expected  # one character at a time


def test_vllm_streaming_interface():
    parser = get_reasoning_parser("deepseek_r1")
    reply = "<think>ab</think>cd"
    got_r = got_c = ""
    for i in range(len(reply)):
        delta = parser.extract_reasoning_streaming(reply[:i], reply[:i + 1], reply[i], final=i == len(reply) - 1)
        if delta is not None:
            got_r += delta.reasoning or ""
            got_c += delta.content or ""
    assert (got_r, got_c) == ("ab", "cd")


def test_prompt_state():
    parser = get_reasoning_parser("qwen3")
    assert parser.prompt_in_reasoning("<|im_start|>assistant\n<think>\n") is True
    assert parser.prompt_in_reasoning("assistant\n<think>\n\n</think>\n\n") is False
    assert parser.prompt_in_reasoning("assistant\n") is None
    assert get_reasoning_parser("granite").prompt_in_reasoning("<think>") is None


TOKENS = ReasoningTokens(start_ids=(1, 2), end_ids=(3, 4, 5))


def test_gate_follows_the_thinking():
    gate = ReasoningGate(TOKENS, None, prompt_token_ids=[9, 9])
    assert not gate.ended
    assert [gate.accept(t) for t in (7, 3, 4, 5, 8)] == [True, True, True, True, False]
    assert gate.ended and gate.forced_token() is None
    assert ReasoningGate(TOKENS, None, [1, 2, 6, 3, 4, 5, 6]).ended  # the prompt closed the thinking
    assert not ReasoningGate(TOKENS, None, [3, 4, 5, 1, 2]).ended  # the prompt opened a new one


def test_gate_forces_the_end_marker_once_the_budget_is_spent():
    gate = ReasoningGate(TOKENS, 2, prompt_token_ids=[])
    gate.accept(1), gate.accept(2)  # the opening marker restarts the count
    assert gate.forced_token() is None
    gate.accept(7)
    assert gate.forced_token() is None
    gate.accept(8)
    forced = []
    while (t := gate.forced_token()) is not None:
        forced.append(t)
        gate.accept(t)
    assert forced == [3, 4, 5] and gate.ended
    zero = ReasoningGate(TOKENS, 0, prompt_token_ids=[])
    zero.accept(3)  # the model began the marker itself: the rest of it is forced
    assert zero.forced_token() == 4
