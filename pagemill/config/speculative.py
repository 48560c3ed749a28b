"""SpeculativeConfig: who proposes draft tokens and how many per step (the keys of --speculative-config)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pagemill.config.model import ModelConfig
from pagemill.utils.config_json import config_from_user

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): who proposes draft tokens and how many per step.

    Proposals are verified by the target model in one step with an exact rejection sampler; a back-off turns
    speculation off for requests whose drafts are rarely accepted and for batches too large to verify for free.
    These keys are the JSON object's; EngineArgs.speculative_config documents the argument itself.
    """

    method: str = "ngram"  # ngram (prompt lookup) | suffix (suffix tree, model-free) | draft_model
    num_speculative_tokens: int | None = None  # k; default 4 (ngram, draft_model) or 8 (suffix)
    prompt_lookup_min: int = 2  # ngram: shortest n-gram to match
    prompt_lookup_max: int = 5  # ngram: longest n-gram to match
    model: str | None = None  # draft_model: a smaller model with the target's tokenizer (default: the target)
    draft_num_layers: int | None = None  # draft_model: use only the draft's first N layers
    suffix_decoding_max_tree_depth: int = 24  # suffix: longest context suffix matched / stored
    suffix_decoding_max_cached_requests: int = 1000  # suffix: finished requests kept in the global tree
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: at most this x the match length draft tokens
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop drafting below this estimated probability
    # Back-off: no drafts while the running batch is this large or more (verification stops being free) ...
    max_batch_size: int = 8
    # ... nor for a request whose recent acceptance (tokens accepted per draft token, moving average) is below this
    # or below the measured cost of proposing and verifying a draft token, if higher (negative: no back-off).
    min_acceptance_rate: float = 0.15
    # draft_model with `model`: the draft's ModelConfig, resolved with the engine's (not user input).
    draft_model_config: ModelConfig | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}.")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 8 if self.method == "suffix" else 4
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 32], "
                             f"got {self.num_speculative_tokens}.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}.")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"speculative_config.draft_num_layers must be >= 1, got {self.draft_num_layers}.")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError("speculative_config.suffix_decoding_max_tree_depth must be >= 1.")
        if self.max_batch_size < 1:
            raise ValueError("speculative_config.max_batch_size must be >= 1.")

    @classmethod
    def from_user(cls, value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Build from a dict, its JSON text (the CLI's --speculative-config) or a config; None stays None.
        Unknown keys raise a ValueError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        known = {f.name for f in fields(cls)} - {"draft_model_config"}
        return config_from_user(cls, value, "speculative_config", known)
