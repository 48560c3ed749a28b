"""Pydantic models of the OpenAI API requests and responses (plus vLLM's extra request fields).

As in vLLM, a request field this server does not know is ignored with a warning (a log line, and the
`X-Ignored-Fields` response header naming the top-level ones), so clients written for other servers keep working.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.sampling_params import INT64_MAX, INT64_MIN

logger = logging.getLogger(__name__)


def find_unusable_value(body: Any) -> tuple[str, str] | None:
    """(field path, problem) of the first value in a parsed JSON body that nothing downstream can take: a string
    with a lone UTF-16 surrogate (no UTF-8 form) or an integer outside the signed 64-bit range; else None."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path, "contains a lone surrogate (\\ud800-\\udfff), which is not valid Unicode text"
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            if not INT64_MIN <= value <= INT64_MAX:
                return path, "is outside the signed 64-bit integer range"
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not key.isascii():
                    try:
                        key.encode("utf-8")
                    except UnicodeEncodeError:
                        return path or None, "has a key with a lone surrogate, which is not valid Unicode text"
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


@functools.cache
def _field_keys(cls: type[BaseModel]) -> frozenset[str]:
    """The keys a request model takes: its field names and their aliases."""
    return frozenset(n for name, f in cls.model_fields.items() for n in (name, f.alias) if n)


class OpenAIBaseModel(BaseModel):
    """Base of all request models: unknown fields are ignored with a warning (vLLM's behaviour), values must have
    the documented JSON type (strict: no "true" for a boolean, no 1.0 for an integer), floats must be finite,
    strings valid Unicode and integers 64-bit."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    _ignored_fields: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _check_values(cls, data: Any) -> Any:
        """400 naming the field for a value no later stage can encode (a nested model re-checks its own part)."""
        found = find_unusable_value(data)
        if found is not None:
            path, problem = found
            raise OpenAIError(f"{path or 'The request'} {problem}.", 400, path or None)
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored_fields(cls, data: Any, handler: Any) -> Any:
        """Log the keys of `data` that are not fields of this model (they are dropped) and keep their names."""
        result = handler(data)
        if isinstance(data, dict) and isinstance(result, OpenAIBaseModel) and cls.model_config.get("extra") == "ignore":
            known = _field_keys(cls)
            ignored = [str(k) for k in data if k not in known]
            if ignored:
                logger.warning("The following fields were present in the request but ignored: %s", ignored)
                result._ignored_fields = ignored
        return result

    @property
    def ignored_fields(self) -> list[str]:
        """The request's top-level keys that were ignored."""
        return self._ignored_fields


class ResponseModel(BaseModel):
    """Base of all response models."""

    model_config = ConfigDict(extra="allow")


# ---- errors ----
class ErrorInfo(ResponseModel):
    """The body of an OpenAI-style error."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(ResponseModel):
    """`{"error": {...}}`."""

    error: ErrorInfo


# ---- models ----
class ModelCard(ResponseModel):
    """One entry of /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagemill"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    runner: str | None = None  # generate | pooling: what the model does
    supported_tasks: list[str] | None = None  # generate, or the pooling tasks (embed, score, classify, encode)


class ModelList(ResponseModel):
    """The /v1/models response."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- shared pieces ----
class PromptTokenUsageInfo(ResponseModel):
    """`usage.prompt_tokens_details`: how many prompt tokens came from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    """Token counts of a request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


def usage_info(num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
    """`usage` with the prompt's prefix-cache hits in prompt_tokens_details.cached_tokens."""
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=num_cached))


class StreamOptions(OpenAIBaseModel):
    """`stream_options` of a streamed request."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """`response_format.json_schema`: a named JSON schema the reply must follow."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """`response_format`: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request field: the fields of StructuredOutputsParams."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    model_config = ConfigDict(populate_by_name=True)


class SamplingRequest(OpenAIBaseModel):
    """Fields that completions and chat completions share, OpenAI's and vLLM's extras."""

    model: str | None = None
    n: int = Field(default=1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM extra parameters
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None  # with logprobs: these tokens' logprobs too, at every position
    prompt_logprobs: int | None = Field(default=None, ge=0)
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the response
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>" (for tokens that are not text)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep k prompt tokens (-1: the model's limit)
    truncation_side: Literal["left", "right"] = "left"  # left: keep the last k tokens
    use_beam_search: bool = False  # beam search with n beams (vLLM)
    length_penalty: float = 1.0  # beam search's length penalty
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted as vLLM does; fast tokenizers have no such option
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None
    speculative_decoding: bool = True  # False: no draft tokens for this request when the server speculates
    expected_output_tokens: int | None = Field(default=None, ge=0)  # srtf / two-level: expected output length
    thinking_token_budget: int | None = Field(default=None, ge=0)  # with --reasoning-parser: most thinking tokens
    # structured output: OpenAI's response_format, vLLM's structured_outputs, and the older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


# ---- completions ----
class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = None
    add_special_tokens: bool = True


class PromptLogprob(ResponseModel):
    """One candidate of a prompt position (vLLM's prompt_logprobs entry)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogProbs(ResponseModel):
    """Legacy completions logprobs: parallel lists over the generated tokens."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(ResponseModel):
    """One generated text."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(ResponseModel):
    """The non-streamed /v1/completions response (also each streamed chunk, with a usage of None)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- chat completions ----
class TextContentPart(OpenAIBaseModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ImageURL(OpenAIBaseModel):
    """An image by URL: data:image/...;base64, file:// (under --allowed-local-media-path) or http(s)://."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the resolution


class ImageContentPart(OpenAIBaseModel):
    """An image part of a message's content (a vision-language model's input)."""

    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCallParam(OpenAIBaseModel):
    """The function of a tool call in an assistant message: its name and its arguments (JSON text)."""

    name: str
    arguments: str | dict[str, Any]


class ToolCallParam(OpenAIBaseModel):
    """A tool call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIBaseModel):
    """One message of a conversation (assistant messages may carry tool calls, tool messages their results).

    Any role is taken (`developer`, or a custom one such as `ipython`) and rendered by the chat template as it is;
    keys beyond OpenAI's reach the template too, as vLLM passes them.
    """

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextContentPart))

    def has_images(self) -> bool:
        """Whether the content has an image part."""
        return isinstance(self.content, list) and any(isinstance(p, ImageContentPart) for p in self.content)

    def to_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: role, text content, and tool calls (their arguments as objects,
        as HF templates expect) or the id of the call a tool message answers."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.has_images():  # the parts as they are: multimodal.chat.take_images turns them into text + images
            out["content"] = [p.model_dump(exclude_none=True) for p in self.content]
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        for key, value in (self.model_extra or {}).items():
            out.setdefault(key, value)
        return out


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    """Tool-call arguments as a JSON value when they are JSON text (else the text itself)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDefinition(OpenAIBaseModel):
    """A function the model may call: name, description and a JSON schema of its parameters."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    """The function a named tool_choice forces."""

    name: str


class NamedToolChoice(OpenAIBaseModel):
    """`tool_choice={"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extra parameters
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # with --reasoning-parser: False drops the reasoning from the reply


class ChatLogProb(ResponseModel):
    """One candidate token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    """The chosen token at a position, with the top candidates."""

    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatLogProbsContent] | None = None


class FunctionCall(ResponseModel):
    """A generated function call: name and arguments (JSON text)."""

    name: str
    arguments: str


class ToolCall(ResponseModel):
    """A generated tool call."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(ResponseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # with --reasoning-parser (vLLM's current name)
    reasoning_content: str | None = None  # the same, by its older name (vLLM < 0.11, DeepSeek's API)


class ChatCompletionResponseChoice(ResponseModel):
    """One generated reply."""

    index: int
    message: AssistantMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(ResponseModel):
    """The non-streamed /v1/chat/completions response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(ResponseModel):
    """A piece of a streamed function call: the name (first chunk only) and an arguments fragment."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """A piece of a streamed tool call; the first piece of a call carries its id and type."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(ResponseModel):
    """What a streamed chunk adds to a reply."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser; also as reasoning_content (vLLM's older name)
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(ResponseModel):
    """One choice of a streamed chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(ResponseModel):
    """One streamed chunk of /v1/chat/completions."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


# ---- tokenizer endpoints ----
class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ChatCompletionToolsParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(ResponseModel):
    """Token ids of the input."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    """The text of the tokens."""

    prompt: str


# ---- pooling models: embeddings, pooling, score, rerank ----
class PoolingInputRequest(OpenAIBaseModel):
    """What /v1/embeddings and /pooling share: OpenAI's input forms plus vLLM's extras."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extra parameters
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    normalize: bool | None = None
    priority: int = 0


class EmbeddingRequest(PoolingInputRequest):
    """POST /v1/embeddings."""


class EmbeddingResponseData(ResponseModel):
    """One embedding: a list of floats, or base64 of their little-endian float32 bytes."""

    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(ResponseModel):
    """The /v1/embeddings response."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingRequest(PoolingInputRequest):
    """POST /pooling: the pooler's raw output (the model's default head) for each input."""

    activation: bool | None = None


class PoolingResponseData(ResponseModel):
    """One pooled vector."""

    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(ResponseModel):
    """The /pooling response."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ScoreRequest(OpenAIBaseModel):
    """POST /score: text_1 against text_2 (1 x 1, 1 x N or N x N)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    activation: bool | None = None
    priority: int = 0


class ScoreResponseData(ResponseModel):
    """The score of one pair."""

    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    """The /score response."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankRequest(OpenAIBaseModel):
    """POST /rerank, /v1/rerank (Jina / Cohere style): documents ordered by relevance to the query."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    activation: bool | None = None
    priority: int = 0


class RerankDocument(ResponseModel):
    """A reranked document's text."""

    text: str


class RerankResult(ResponseModel):
    """One document's place in the ranking."""

    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(ResponseModel):
    """Tokens of a rerank request."""

    total_tokens: int


class RerankResponse(ResponseModel):
    """The /rerank response: results sorted by relevance, best first."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
