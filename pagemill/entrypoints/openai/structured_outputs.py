"""The output constraint of a request: from `response_format`, vLLM's `structured_outputs`, or the older
`guided_*` fields (and a forced tool choice), as one StructuredOutputsParams; conflicts are 400s naming the fields."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.protocol import SamplingRequest
from pagemill.sampling_params import StructuredOutputsParams

GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}
# Names clients send in guided_decoding_backend; the engine picks the backend, so a known name is only accepted.
BACKENDS = ("auto", "xgrammar", "guidance", "llguidance", "outlines", "lm-format-enforcer")


@dataclass
class OutputConstraint:
    """A request's constraint and the request field it came from (errors about it name that field)."""

    params: StructuredOutputsParams
    field: str
    error_field: str | None = None  # the field an invalid constraint blames, if not `field`

    @property
    def blamed_field(self) -> str:
        """The request field an error about this constraint names."""
        return self.error_field or self.field


def _build(field: str, **kwargs: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams, with its ValueError turned into a 400 about `field`."""
    if isinstance(kwargs.get("json"), str):
        try:
            json.loads(kwargs["json"])
        except ValueError as e:
            raise OpenAIError(f"{field}: the JSON schema is not valid JSON: {e}.", 400, field) from e
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise OpenAIError(f"{field}: {e}", 400, field) from e


def _from_response_format(request: SamplingRequest) -> OutputConstraint | None:
    rf = request.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return OutputConstraint(_build("response_format", json_object=True), "response_format")
    if rf.json_schema is None:
        raise OpenAIError("response_format of type json_schema needs a json_schema object.", 400,
                          "response_format.json_schema")
    if rf.json_schema.json_schema is None:
        raise OpenAIError("response_format.json_schema needs a schema.", 400, "response_format.json_schema.schema")
    return OutputConstraint(_build("response_format", json=rf.json_schema.json_schema), "response_format")


def _from_structured_outputs(request: SamplingRequest) -> OutputConstraint | None:
    so = request.structured_outputs
    if so is None:
        return None
    fields = so.model_dump(exclude_unset=True, by_alias=True)
    return OutputConstraint(_build("structured_outputs", **fields), "structured_outputs")


def _from_guided(request: SamplingRequest) -> OutputConstraint | None:
    given = [f for f in GUIDED_KINDS if getattr(request, f) is not None]
    if len(given) > 1:
        raise OpenAIError(f"Give only one of {', '.join(given)}.", 400, ",".join(given))
    if not given:
        if request.guided_whitespace_pattern is not None:
            raise OpenAIError("guided_whitespace_pattern needs one of guided_json, guided_regex, guided_choice or "
                              "guided_grammar.", 400, "guided_whitespace_pattern")
        return None
    field = given[0]
    return OutputConstraint(_build(field, **{GUIDED_KINDS[field]: getattr(request, field),
                                             "whitespace_pattern": request.guided_whitespace_pattern}), field)


def check_backend(request: SamplingRequest) -> None:
    """400 for a guided_decoding_backend nobody knows (a known one is accepted; the engine chooses the backend)."""
    backend = request.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise OpenAIError(f"guided_decoding_backend must be one of {', '.join(BACKENDS)}, got {backend!r}.", 400,
                          "guided_decoding_backend")


def output_constraint(request: SamplingRequest, tool_constraint: OutputConstraint | None = None
                      ) -> OutputConstraint | None:
    """The one constraint of a request, from whichever field gives it; a 400 naming the fields if several do."""
    check_backend(request)
    found = [c for c in (_from_response_format(request), _from_structured_outputs(request), _from_guided(request),
                         tool_constraint) if c is not None]
    if len(found) > 1:
        fields = [c.field for c in found]
        raise OpenAIError(f"Only one output constraint can be given; this request sets {', '.join(fields)}.", 400,
                          ",".join(fields))
    return found[0] if found else None
