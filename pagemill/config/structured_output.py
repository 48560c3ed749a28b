"""StructuredOutputsConfig: which grammar library compiles structured-output constraints, and its options."""

from __future__ import annotations

from dataclasses import dataclass

STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class StructuredOutputsConfig:
    """Structured output (guided decoding): vLLM's structured_outputs_config keys (EngineArgs documents them) plus
    what --reasoning-parser and --reasoning-config resolve to."""

    backend: str = "auto"
    max_json_whitespace: int = 2  # most whitespace characters between JSON tokens (0: none)
    # A grammar starts after the reasoning end marker, and thinking_token_budget forces that marker; the start / end
    # strings override the parser's.
    reasoning_parser: str | None = None
    reasoning_start_str: str | None = None
    reasoning_end_str: str | None = None
    # Each is also the default of the request field of the same name.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                     "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be a boolean, got {getattr(self, name)!r}.")
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                             f"got {self.backend!r}.")
        if self.max_json_whitespace < 0:
            raise ValueError("structured_outputs max_json_whitespace must be >= 0.")
