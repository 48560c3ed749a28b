"""What the scheduler hands the model runner for one step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagemill.lora.request import LoRARequest
from pagemill.messages import LogprobsLists, MultiModalFeature
from pagemill.pooling_params import PoolingParams
from pagemill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption): all its tokens and blocks."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # one block table per KV cache group (equal lengths)
    num_computed_tokens: int
    eos_token_id: int | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # a pooling request (the runner pools instead of sampling)
    token_type_ids: list[int] | None = None  # an encoder's segment ids (None: all zeros)
    mm_features: list[MultiModalFeature] | None = None  # the prompt's images (pixels and placeholder spans)


@dataclass
class CachedRequestData:
    """A running request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[list[int]]  # per KV cache group (equal lengths)
    num_computed_tokens: int
    replaced_block_ids: list[tuple[int, int, int]] | None = None  # (group, table index, block id) after copy-on-write
    # The tables were cut to this many blocks (the blocks of rejected draft tokens were freed) before new_block_ids.
    num_blocks_kept: int | None = None


@dataclass
class SchedulerOutput:
    """One step's plan: which requests run and how many tokens each computes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the forward
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (KV block, swap block), first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap block, KV block), second
    # Structured output: the step's token bitmask being filled (structured_output.manager.GrammarStep), or None.
    grammar: Any = None
    # Speculative decoding: the draft tokens scheduled for verification, per request that has any ...
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # ... and how many draft tokens to propose for each request's next step (absent: none).
    num_spec_tokens_to_propose: dict[str, int] = field(default_factory=dict)
    # A KV connector's loads and saves for the step (distributed/kv_transfer), or None.
    kv_connector_metadata: Any = None


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (for each request that reached the end of its known tokens), logprobs and draft tokens."""

    sampled: dict[str, list[int]]  # accepted draft tokens then one sampled token (one token without speculation)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per runner section (with --profile)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals for the next step
    # Seconds of proposing per draft position, over the seconds of this step's target forward and sampling.
    draft_cost: float | None = None
    # Seconds of this step's target forward and sampling (with speculation configured): the verification cost model.
    target_seconds: float | None = None
    pooler_output: dict[str, bytes] = field(default_factory=dict)  # pooling requests whose prompt is computed
