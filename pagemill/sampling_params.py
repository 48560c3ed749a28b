"""Sampling parameters of a request, named and validated as in vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

_SAMPLING_EPS = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_INT64_FIELDS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                 "truncate_prompt_tokens", "expected_output_tokens")


def wrap_int64(value: int) -> int:
    """`value` wrapped into the signed 64-bit range (a child sequence's seed: the parent's seed + its index)."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _token_id(key: object) -> int:
    """A logit_bias key as a token id (JSON object keys arrive as strings)."""
    try:
        token = int(key)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}.") from None
    if token < 0:
        raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}.")
    return token


class RequestOutputKind(IntEnum):
    """How outputs are reported while a request runs (vLLM's names)."""

    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass
class StructuredOutputsParams:
    """One output constraint of a request (vLLM's StructuredOutputsParams): exactly one of json (a JSON schema, as
    a dict or its text), regex, choice, grammar (EBNF/GBNF or Lark), json_object=True or structural_tag."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # Set by the engine: the backend that compiles this request's grammar (xgrammar | guidance).
    _backend: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {', '.join(given) or 'none'}.")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}.")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar, json_object or structural_tag."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name, still sent by many clients


@dataclass
class SamplingParams:
    """How to sample the tokens of one request: the fields and defaults of vLLM's SamplingParams."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older spelling of structured_outputs
    speculative_decoding: bool = True  # False: this request never gets draft tokens (when the engine speculates)
    allowed_token_ids: list[int] | None = None  # sample only among these tokens
    logprob_token_ids: list[int] | None = None  # with `logprobs`: also these tokens' logprobs at every position
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit (OpenAI: [-100, 100])
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len - 1)
    # srtf / two-level scheduling: the output length to expect (a hint, capped by max_tokens; None: max_tokens).
    expected_output_tokens: int | None = None
    # With a reasoning parser: after this many thinking tokens the engine forces the end-of-thinking marker.
    thinking_token_budget: int | None = None
    # Filled in by the engine from the model's generation config; not user input.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0  # vLLM treats -1 as "off"; 0 means off here too
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, what: str) -> ValueError:
            return ValueError(f"{name} {what}, got {getattr(self, name)!r}.")

        for name in _INT64_FIELDS:  # what reaches the engine core must fit its 64-bit fields
            value = getattr(self, name)
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                raise bad(name, "must fit in a signed 64-bit integer")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and self.best_of < self.n:
            raise bad("best_of", f"must be >= n ({self.n})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "must be a finite number > 0")
        if not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite non-negative number")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1 or 0 (off) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.expected_output_tokens is not None and (
                isinstance(self.expected_output_tokens, bool) or not isinstance(self.expected_output_tokens, int)
                or self.expected_output_tokens < 0):
            raise bad("expected_output_tokens", "must be an integer >= 0")
        if self.thinking_token_budget is not None and (isinstance(self.thinking_token_budget, bool) or not isinstance(
                self.thinking_token_budget, int) or self.thinking_token_budget < 0):
            raise bad("thinking_token_budget", "must be an integer >= 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be non-negative")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}.")
        if any(not isinstance(t, int) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.logprob_token_ids is not None:
            if any(not isinstance(t, int) or t < 0 for t in self.logprob_token_ids):
                raise bad("logprob_token_ids", "must be a list of non-negative token ids")
            if self.logprobs is None:
                self.logprobs = 0  # the chosen token's logprob comes with them, as with logprobs=0
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to biases")
            self.logit_bias = {_token_id(k): float(v) for k, v in self.logit_bias.items()}
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < -1
                                                        or self.truncate_prompt_tokens == 0):
            raise bad("truncate_prompt_tokens", "must be -1 or an integer >= 1")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < _SAMPLING_EPS

    def clone(self, **changes: object) -> "SamplingParams":
        """A copy with some fields changed (used to fan out n > 1 into child requests)."""
        data = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "all_stop_token_ids"}
        data.update(changes)
        out = SamplingParams(**data)
        out.all_stop_token_ids = set(self.all_stop_token_ids)
        return out


@dataclass
class BeamSearchParams:
    """Beam search settings, named as in vLLM (which defines them here too; the search is in beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
