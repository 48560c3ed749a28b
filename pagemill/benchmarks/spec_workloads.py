"""The three request sets of `bench speculative` (issue 13's performance section), as prompt token ids.

- edit: chat prompts asking the model to repeat or lightly edit a corpus paragraph (the answer overlaps the prompt);
- sharegpt: the ShareGPT-like free-generation set of `bench throughput --dataset-name sharegpt`;
- code: the first part of a Python standard-library module (real source, offline), for the model to continue.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pagemill.benchmarks.corpus import CORPUS_TEXT
from pagemill.benchmarks.datasets import sharegpt_dataset
from pagemill.benchmarks.prompts import PromptBuilder
from pagemill.entrypoints.chat_utils import ChatRenderer

WORKLOADS = ("edit", "sharegpt", "code")

EDIT_INSTRUCTIONS = (
    "Repeat the following text exactly, word for word, and write nothing else.",
    "Correct any spelling or punctuation mistakes in the following paragraph and return the whole paragraph. "
    "Change nothing else.",
    "Rewrite the following paragraph in modern English, keeping every sentence and its order.",
    "Copy the following paragraph, replacing every \"and\" with \"&\". Keep everything else the same.",
    "Split the long sentences of the following paragraph into shorter ones, keeping the same words.",
)  # five instructions and six corpus paragraphs: 30 distinct prompts before any repeats

# Pure-Python standard-library modules of 300+ lines: the code-completion files.
CODE_MODULES = ("textwrap", "shlex", "heapq", "calendar", "json.decoder", "queue", "difflib", "fractions", "string")


def corpus_paragraphs() -> list[str]:
    """The paragraphs of the built-in corpus (public-domain prose)."""
    return [" ".join(p.split()) for p in CORPUS_TEXT.split("\n\n") if p.strip()]


def edit_messages(num_prompts: int) -> list[list[dict[str, str]]]:
    """Chat conversations `instruction + paragraph`, cycling through all (instruction, paragraph) pairs."""
    paragraphs = corpus_paragraphs()
    return [[{"role": "user", "content": f"{EDIT_INSTRUCTIONS[k % len(EDIT_INSTRUCTIONS)]}\n\n"
                                         f"{paragraphs[k % len(paragraphs)]}"}] for k in range(num_prompts)]


def edit_prompts(tokenizer: Any, num_prompts: int) -> list[list[int]]:
    """Workload (a): the edit conversations rendered with the model's chat template."""
    renderer = ChatRenderer(tokenizer)
    return [renderer.render(messages) for messages in edit_messages(num_prompts)]


def sharegpt_prompts(tokenizer: Any, num_prompts: int, output_len: int, seed: int = 0) -> list[list[int]]:
    """Workload (b): ShareGPT-like prompts (lengths of the ShareGPT trace, natural corpus text)."""
    samples = sharegpt_dataset(PromptBuilder(tokenizer), num_prompts, output_len, seed)
    return [list(s.prompt_token_ids or []) for s in samples]


def python_source(module: str) -> str:
    """The source file of a standard-library module."""
    return inspect.getsource(importlib.import_module(module))


def code_prompts(tokenizer: Any, num_prompts: int, prompt_len: int = 512) -> list[list[int]]:
    """Workload (c): the first ~`prompt_len` tokens of a stdlib module, cut after a whole line (a later cut on
    each pass through CODE_MODULES, so prompts stay distinct)."""
    prompts = []
    for k in range(num_prompts):
        source = python_source(CODE_MODULES[k % len(CODE_MODULES)])
        budget = prompt_len + (k // len(CODE_MODULES)) * 64
        ids = tokenizer.encode(source, add_special_tokens=False)[:budget]
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        text = text[:text.rfind("\n") + 1] or text
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def build_workload(name: str, tokenizer: Any, num_prompts: int, output_len: int, seed: int = 0,
                   code_prompt_len: int = 512) -> list[list[int]]:
    """The prompt token ids of workload `name` (one of WORKLOADS)."""
    if name == "edit":
        return edit_prompts(tokenizer, num_prompts)
    if name == "sharegpt":
        return sharegpt_prompts(tokenizer, num_prompts, output_len, seed)
    if name == "code":
        return code_prompts(tokenizer, num_prompts, code_prompt_len)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
