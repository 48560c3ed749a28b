"""Pydantic models of OpenAI's Responses API (POST /v1/responses): text and function tools in (message,
function_call and function_call_output items), message, reasoning and function_call items out, plus the sampling
extras vLLM accepts there."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from pagemill.entrypoints.openai.protocol import (ChatLogProbsContent, OpenAIBaseModel, ResponseModel,
                                                  SamplingRequest, StructuredOutputsRequest)

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


class FunctionCallItem(OpenAIBaseModel):
    """A function call the model made in an earlier turn (as a previous response's output item gives it back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    """The result of a function call, for the model to read: text, or a list of input_text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        """The output as one string."""
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningTextPart(OpenAIBaseModel):
    """Reasoning text of a reasoning item (or its summary)."""

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInputItem(OpenAIBaseModel):
    """A reasoning item of an earlier response (accepted; thinking is not shown to the model again, as vLLM)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in ("function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningInputItem, Tag("reasoning")], Discriminator(_item_type)]

Input = Annotated[Annotated[str, Tag("Text")] | Annotated[list[InputItem], Tag("Items")],
                  Discriminator(_text_or_items)]


class FunctionTool(OpenAIBaseModel):
    """A function the model may call (`tools` entry; the only tool type this server runs)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(OpenAIBaseModel):
    """`tool_choice={"type": "function", "name": ...}`: call this function."""

    type: Literal["function"]
    name: str


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
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
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
    thinking_token_budget: int | None = Field(default=None, ge=0)  # with --reasoning-parser
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's output constraint (else text.format)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

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
                  "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "priority", "cache_salt",
                  "thinking_token_budget", "structured_outputs")


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


class ResponseFunctionToolCall(ResponseModel):
    """A function call the model made (`function_call` output item); answer it with a function_call_output item
    carrying the same call_id."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseReasoningText(ResponseModel):
    """The thinking text of a reasoning item."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(ResponseModel):
    """The model's thinking (with --reasoning-parser)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ResponseOutputMessage | ResponseFunctionToolCall | ResponseReasoningItem


class InputTokensDetails(ResponseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    """Output tokens spent on reasoning (with --reasoning-parser)."""

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
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | ToolChoiceFunction = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
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
        """The text of the output message(s)."""
        return "".join(part.text for item in self.output if isinstance(item, ResponseOutputMessage)
                       for part in item.content)
