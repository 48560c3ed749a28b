"""InputBatch's batched bookkeeping: one sampled token per row recorded in one pass (rows at the context limit
count it without storing it), and the argmax-sampling flags that let a batch skip per-row sampling metadata."""

from __future__ import annotations

import numpy as np

from pagemill.core.sched_output import NewRequestData
from pagemill.sampling_params import SamplingParams
from pagemill.worker.input_batch import InputBatch, samples_argmax


def test_append_tokens_matches_append_token():
    one, many = InputBatch(4, 6, 2), InputBatch(4, 6, 2)
    params = SamplingParams(temperature=0)
    for ib in (one, many):
        for rid, toks in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7, 8, 9]), ("c", [10])):
            ib.add_request(NewRequestData(rid, toks, len(toks), params, [[0]], 0))
    rows = np.array([one.req_id_to_row[r] for r in ("c", "a", "b")])
    tokens = np.array([21, 22, 23])
    for r, t in zip(rows, tokens):
        one.append_token(int(r), int(t))
    many.append_tokens(rows, tokens)
    assert (one.token_ids == many.token_ids).all() and (one.num_tokens == many.num_tokens).all()
    assert many.num_tokens[many.req_id_to_row["b"]] == 7  # past max_model_len: counted, not stored


def test_plain_greedy_flag():
    ib = InputBatch(4, 8, 2)
    cases = {"greedy": SamplingParams(temperature=0), "sampled": SamplingParams(temperature=0.7),
             "logprobs": SamplingParams(temperature=0, logprobs=2),
             "penalty": SamplingParams(temperature=0, presence_penalty=0.5),
             "min_tokens": SamplingParams(temperature=0, min_tokens=3)}
    assert [samples_argmax(p) for p in cases.values()] == [True, False, False, False, True]
    for rid in ("greedy", "penalty", "min_tokens"):
        ib.add_request(NewRequestData(rid, [1, 2], 2, cases[rid], [[0]], 0))
    plain = ib.argmax_sampling & (ib.min_tokens_until == 0)  # argmax from the first output on
    assert plain[ib.req_id_to_row["greedy"]] and not plain[ib.req_id_to_row["penalty"]]
    assert not plain[ib.req_id_to_row["min_tokens"]] and ib.min_tokens_until[ib.req_id_to_row["min_tokens"]] == 3
    row = ib.req_id_to_row["greedy"]
    ib.remove_request("greedy")
    assert not ib.argmax_sampling[row]
