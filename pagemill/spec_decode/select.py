"""Pick the draft-token proposer a speculative config names."""

from __future__ import annotations

from typing import Any

from pagemill.config import SpeculativeConfig
from pagemill.spec_decode.proposer import DraftProposer, TokenDraftProposer, make_token_proposer


def make_proposer(config: SpeculativeConfig, runner: Any) -> DraftProposer:
    """The DraftProposer for `config.method`: a model-free token proposer (ngram, suffix) or the draft model, which
    runs inside `runner` (the model runner: its KV block tables and attention machinery)."""
    if config.method == "draft_model":
        from pagemill.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, runner)
    return TokenDraftProposer(make_token_proposer(config))
