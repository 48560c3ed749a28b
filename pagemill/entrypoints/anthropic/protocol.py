"""Anthropic Messages API request and response bodies (the fields the `anthropic` SDK sends and reads). Requests
follow the OpenAI models' rules: strict JSON types, unknown fields (cache_control, metadata, ...) ignored with a
warning."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from pagemill.entrypoints.openai.protocol import OpenAIBaseModel


class TextBlock(OpenAIBaseModel):
    """A text content block."""

    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIBaseModel):
    """An assistant's call of a tool (in a conversation's earlier turns, or in a reply)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ThinkingBlock(OpenAIBaseModel):
    """An assistant's earlier thinking, sent back in a conversation (dropped from the prompt, as chat templates drop
    earlier reasoning)."""

    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(OpenAIBaseModel):
    """Encrypted thinking sent back in a conversation (dropped from the prompt)."""

    type: Literal["redacted_thinking"]
    data: str = ""


class ThinkingConfig(OpenAIBaseModel):
    """`thinking`: enabled (budget_tokens: most thinking tokens, with --reasoning-parser) or disabled (the template
    is rendered with enable_thinking=False)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


class ToolResultBlock(OpenAIBaseModel):
    """A user turn's result of a tool call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class InputMessage(OpenAIBaseModel):
    """One conversation turn: a string, or content blocks."""

    role: Literal["user", "assistant"]
    content: str | Annotated[list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock],
                             Field(min_length=1)]


class Tool(OpenAIBaseModel):
    """A client tool: name, description and the JSON schema of its input."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(OpenAIBaseModel):
    """auto (the model decides), any (some tool), tool (this `name`), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(OpenAIBaseModel):
    """POST /v1/messages."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CountTokensRequest(OpenAIBaseModel):
    """POST /v1/messages/count_tokens: a Messages request without sampling fields."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class AnthropicErrorDetail(BaseModel):
    """What went wrong: Anthropic's error type (invalid_request_error, not_found_error, ...) and a message."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error of the Messages endpoints."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
