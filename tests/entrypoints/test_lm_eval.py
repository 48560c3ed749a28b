"""lm-evaluation-harness against a real `pagemill serve` (issue 22): `local-completions` runs a loglikelihood
(multiple-choice) task, with the tokenizer taken from the server (/tokenizer_info + /tokenize), and its
loglikelihoods equal HF transformers' log-softmax over the same tokens within 1e-4; `local-chat-completions` runs a
generate_until task. The tasks and their data are written here: nothing is downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.entrypoints.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

QUESTIONS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "Which colour is the sky on a clear day?", "choices": ["green", "red", "blue"], "answer": 2},
    {"question": "What do bees make?", "choices": ["honey", "milk", "silk"], "answer": 0},
]

MC_TASK = """task: pagemill_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GEN_TASK = """task: pagemill_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} Answer in one word."
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    data = d / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (d / "pagemill_mc.yaml").write_text(MC_TASK.format(data=data))
    (d / "pagemill_gen.yaml").write_text(GEN_TASK.format(data=data))
    return d


def _evaluate(model: str, model_args: dict, task: str, task_dir: Path, **kwargs) -> dict:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    os.environ["OPENAI_API_KEY"] = API_KEY
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                   task_manager=TaskManager(include_path=str(task_dir)), **kwargs)


def test_local_completions_loglikelihoods_equal_hf(server, http, task_dir, smol_hf):
    args = {"base_url": f"{server.url}/v1/completions", "model": MODEL, "num_concurrent": 1, "max_retries": 1,
            "auth_token": API_KEY, "tokenizer_backend": "remote"}
    results = _evaluate("local-completions", args, "pagemill_mc", task_dir)
    samples = results["samples"]["pagemill_mc"]
    assert len(samples) == len(QUESTIONS)
    model = smol_hf[0]

    def encode(text: str) -> list[int]:
        return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    for sample in samples:
        pairs = [(a[0], a[1]) for a in sample["arguments"]]  # what lm-eval scored: (context, continuation)
        assert len(pairs) == len(sample["doc"]["choices"])
        for (context, continuation), (loglikelihood, _) in zip(pairs, [r[0] for r in sample["resps"]]):
            ctx, cont = encode(context), encode(continuation)
            with torch.inference_mode():
                logp = model(torch.tensor([ctx + cont])).logits[0].float().log_softmax(-1)
            want = sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
            assert loglikelihood == pytest.approx(want, abs=1e-4)
    assert 0.0 <= results["results"]["pagemill_mc"]["acc,none"] <= 1.0


def test_local_chat_completions_generate_until(server, task_dir):
    args = {"base_url": f"{server.url}/v1/chat/completions", "model": MODEL, "num_concurrent": 1,
            "max_retries": 1, "auth_token": API_KEY}
    results = _evaluate("local-chat-completions", args, "pagemill_gen", task_dir, apply_chat_template=True)
    samples = results["samples"]["pagemill_gen"]
    assert len(samples) == len(QUESTIONS)
    assert all(isinstance(s["resps"][0][0], str) and s["resps"][0][0].strip() for s in samples)
    assert "exact_match,none" in results["results"]["pagemill_gen"]
