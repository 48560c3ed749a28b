"""Persistent per-request state of the model runner: token ids, block tables, sampling settings.

Rows are kept across steps and updated incrementally (thesis §4.6): a step only writes what changed.
"""

from __future__ import annotations

import numpy as np

from pagemill.core.sched_output import NewRequestData
from pagemill.lora.request import LoRARequest
from pagemill.sampling_params import SamplingParams


class InputBatch:
    """Numpy buffers with one row per live request."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, num_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # One block table per KV cache group; a request's tables have equal lengths (num_blocks).
        self.block_table = np.zeros((num_groups, max_num_reqs, self.max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.eos_token_id: list[int | None] = [None] * max_num_reqs
        self.seeds: dict[int, int] = {}  # row -> seed of a seeded sampled request
        # rows whose sampling reads only the argmax (samples_argmax), once their outputs reach min_tokens_until
        self.argmax_sampling = np.zeros(max_num_reqs, dtype=bool)
        self.min_tokens_until = np.zeros(max_num_reqs, dtype=np.int64)
        # rows whose sampling reads their earlier outputs or their count (reads_output_history)
        self.reads_history = np.zeros(max_num_reqs, dtype=bool)
        # bumped each time a row is freed: a step's deferred tokens land only in rows still held by their requests
        self.row_epoch = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_id_to_row: dict[str, int] = {}
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # each row's adapter id (0: the base model)
        self.lora_requests: dict[int, LoRARequest] = {}  # adapter id -> its request (to reload an evicted adapter)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add_request(self, new: NewRequestData) -> int:
        """Put a (new or resumed) request into a row."""
        if new.req_id in self.req_id_to_row:
            self.remove_request(new.req_id)
        row = self._free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        nb = len(new.block_ids[0])
        self.block_table[:, row, :nb] = new.block_ids
        self.num_blocks[row] = nb
        sp = new.sampling_params
        self.params[row] = sp
        self.eos_token_id[row] = new.eos_token_id
        lora = new.lora_request
        self.lora_ids[row] = lora.lora_int_id if lora is not None else 0
        if lora is not None:
            self.lora_requests[lora.lora_int_id] = lora
        if sp.seed is not None and not sp.greedy:  # (its draws are keyed by output position: preemption-proof)
            self.seeds[row] = sp.seed
        self.argmax_sampling[row] = samples_argmax(sp)
        self.reads_history[row] = reads_output_history(sp)
        # (a structured-output request ends where its grammar does: its mask alone decides when EOS may come)
        self.min_tokens_until[row] = sp.min_tokens if sp.structured_outputs is None else 0
        return row

    def remove_request(self, req_id: str) -> None:
        """Free the request's row (finished, or preempted: a preempted request comes back as a new one)."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.row_epoch[row] += 1
        self.argmax_sampling[row] = False
        self.reads_history[row] = False
        self.lora_ids[row] = 0
        self.seeds.pop(row, None)
        self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        """Extend a row's block tables (one list of new block ids per group, equal lengths)."""
        n = len(block_ids[0])
        if n:
            nb = int(self.num_blocks[row])
            self.block_table[:, row, nb:nb + n] = block_ids
            self.num_blocks[row] = nb + n

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Record one sampled token for each of `rows` (distinct rows)."""
        n = self.num_tokens[rows]
        fits = n < self.max_model_len
        self.token_ids[rows[fits], n[fits]] = token_ids[fits]
        self.num_tokens[rows] = n + 1

    def append_token(self, row: int, token_id: int) -> None:
        """Record a sampled token."""
        n = int(self.num_tokens[row])
        if n < self.max_model_len:
            self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1


def samples_argmax(sp: SamplingParams) -> bool:
    """Whether sampling `sp` reads nothing but the argmax of the raw logits (over a grammar's allowed tokens for a
    constrained request) once no min_tokens mask applies: greedy, no logprobs, penalties, allowed-token list or bias."""
    return bool(sp.greedy and sp.logprobs is None and not sp.presence_penalty and not sp.frequency_penalty
                and sp.repetition_penalty == 1.0 and sp.allowed_token_ids is None and not sp.logit_bias)


def reads_output_history(sp: SamplingParams) -> bool:
    """Whether sampling `sp` reads the request's earlier output tokens or their count (penalties, seeded draws keyed
    by output position, a min_tokens mask): its step needs the previous step's token on the host."""
    return bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
                or (sp.seed is not None and not sp.greedy)
                or (sp.min_tokens and sp.structured_outputs is None))
