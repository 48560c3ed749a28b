"""Pydantic models of OpenAI's Responses API (POST /v1/responses) for the subset served without tools: text in,
text out, plus the sampling extras vLLM accepts there."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from pagemill.entrypoints.openai.protocol import (ChatLogProbsContent, OpenAIBaseModel, ResponseModel,
                                                  SamplingRequest)

# The only `include` value this subset can honour.
INCLUDE_LOGPROBS = "message.output_text.logprobs"


# ---- request ----
class InputTextPart(OpenAIBaseModel):
    """Text a user, system or developer message carries."""

    type: Literal["input_text"]
    text: str


class OutputTextPart(OpenAIBaseModel):
    """Text an earlier assistant reply carried (as a previous response's output item gives it back)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


ContentPart = Annotated[InputTextPart | OutputTextPart, Field(discriminator="type")]


def _text_or_items(value: Any) -> str:
    return "Text" if isinstance(value, str) else "Items"


# A string or a list of parts / items: a bad list is reported against its items, not against the string form.
TextContent = Annotated[Annotated[str, Tag("Text")] | Annotated[list[ContentPart], Tag("Items")],
                        Discriminator(_text_or_items)]


class InputMessage(OpenAIBaseModel):
    """One message item of `input` (an output message of an earlier response is accepted as it is)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextContent
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        """The content as one string (parts joined by newlines)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def to_dict(self) -> dict[str, str]:
        """The message as chat templates take it; `developer` (OpenAI's new name of `system`) becomes `system`."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


Input = Annotated[Annotated[str, Tag("Text")] | Annotated[list[InputMessage], Tag("Items")],
                  Discriminator(_text_or_items)]


class TextFormat(OpenAIBaseModel):
    """`text.format`: plain text, any JSON object, or JSON following a named schema (fields at this level)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    """`text`: the format of the output text."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses: OpenAI's fields of a text-only response, and vLLM's sampling extras."""

    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    include: list[str] | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool = False
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # vLLM extra parameters (the sampling fields chat completions share)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None

    def wants_logprobs(self) -> bool:
        """Whether the output text carries logprobs (`include` asks for them, or `top_logprobs` is given)."""
        return self.top_logprobs is not None or INCLUDE_LOGPROBS in (self.include or [])

    def sampling_request(self) -> SamplingRequest:
        """The sampling fields as the chat and completions handlers take them."""
        fields = {name: getattr(self, name) for name in _SHARED_FIELDS}
        return SamplingRequest.model_validate(fields)


# Fields of ResponsesRequest that mean the same in SamplingRequest.
_SHARED_FIELDS = ("model", "temperature", "top_p", "stream", "user", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "priority", "cache_salt")


# ---- response ----
class ResponseOutputText(ResponseModel):
    """The text part of the output message."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatLogProbsContent] = Field(default_factory=list)


class ResponseOutputMessage(ResponseModel):
    """The assistant message a response outputs."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText] = Field(default_factory=list)


class InputTokensDetails(ResponseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    """Output tokens spent on reasoning (none: this subset has no reasoning parser)."""

    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    """Token counts of a response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    """Why a response stopped before it was complete."""

    reason: Literal["max_output_tokens"]


class ResponsesResponse(ResponseModel):
    """A response object (the non-streamed answer, GET /v1/responses/{id}, and the `response` of lifecycle
    events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[ResponseOutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_p: float = 1.0
    top_logprobs: int | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    store: bool = True
    background: bool = False
    service_tier: str = "auto"
    reasoning: dict[str, Any] | None = None

    @property
    def output_text(self) -> str:
        """The text of the output message."""
        return "".join(part.text for item in self.output for part in item.content)
