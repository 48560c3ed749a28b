"""What `tools` / `tool_choice` / `parallel_tool_calls` mean for one chat request: which tools the template
shows, which parser reads the reply, and (for "required" or a named function) the JSON schema that forces the
reply to be valid calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionToolsParam
from pagemill.entrypoints.openai.structured_outputs import OutputConstraint
from pagemill.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagemill.entrypoints.openai.tool_parsers.forced import AtMostOneCall, NamedFunctionParser, RequiredToolsParser
from pagemill.sampling_params import StructuredOutputsParams

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How a request uses tools: the tools for the template, the reply's parser, and a forcing constraint."""

    tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None
    constraint: OutputConstraint | None = None


def named_function_schema(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    """The schema a forced named function's reply follows: that function's parameters."""
    return tool.function.parameters or NO_PARAMETERS


def required_schema(tools: list[ChatCompletionToolsParam], parallel_tool_calls: bool) -> dict[str, Any]:
    """The schema of `tool_choice="required"` (as vLLM): a list of {"name", "parameters"} calls, each naming one of
    the tools and following its parameters schema; at least one call, at most one without parallel calls."""
    schema: dict[str, Any] = {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [{
            "properties": {"name": {"type": "string", "enum": [t.function.name]},
                           "parameters": t.function.parameters or NO_PARAMETERS},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def plan_tools(request: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    """The ToolPlan of a request; a 400 naming tools or tool_choice for a choice that cannot be honoured.

    `auto_parser` is the server's --tool-call-parser when --enable-auto-tool-choice is on, else None.
    """
    tools = request.tools or None
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's default
    if tools is None:
        if choice not in ("none", "auto"):
            raise OpenAIError("tool_choice needs tools: give the functions the model may call.", 400, "tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise OpenAIError(f"tools has two functions named {duplicate!r}.", 400, "tools")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    parallel = request.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(rendered)
    if choice == "auto":
        if auto_parser is None:
            raise OpenAIError('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                              "--tool-call-parser.", 400, "tool_choice")
        parser = get_tool_parser(auto_parser, rendered)
        if parser.keeps_special_tokens:
            request.skip_special_tokens = False  # the format's markers are special tokens (as vLLM's parsers do)
        return ToolPlan(rendered, parser if parallel else AtMostOneCall(parser))
    if choice == "required":
        schema = required_schema(tools, parallel)
        return ToolPlan(rendered, RequiredToolsParser(), OutputConstraint(StructuredOutputsParams(json=schema),
                                                                          "tool_choice", "tools"))
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise OpenAIError(f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)}).",
                          400, "tool_choice")
    return ToolPlan(rendered, NamedFunctionParser(name),
                    OutputConstraint(StructuredOutputsParams(json=named_function_schema(tool)), "tool_choice", "tools"))
