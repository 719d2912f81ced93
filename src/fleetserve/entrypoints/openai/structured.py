"""The HTTP side of structured outputs: `response_format` (json_object, json_schema) and
vLLM's `structured_outputs` -> one `StructuredOutputsParams`, compiled here once so that
a bad schema, regex, choice list or grammar is a 400 naming the field."""

from __future__ import annotations

from fleetserve.core.structured import StructuredOutputsParams
from fleetserve.entrypoints.openai.errors import APIError
from fleetserve.entrypoints.openai.protocol_tools import ResponseFormat, StructuredOutputsBody
from fleetserve.structured.grammars import check, closed_schema


def _checked(so: StructuredOutputsParams, field: str, json_field: str | None = None) -> None:
    try:
        check(so, field, json_field)
    except ValueError as e:
        raise APIError(400, str(e), field) from None


def from_structured_outputs(body: StructuredOutputsBody | None) -> StructuredOutputsParams | None:
    if body is None:
        return None
    try:
        so = StructuredOutputsParams(
            json=body.json_,
            regex=body.regex,
            choice=body.choice,
            grammar=body.grammar,
            json_object=body.json_object,
        )
    except ValueError as e:
        raise APIError(400, str(e), "structured_outputs") from None
    _checked(so, "structured_outputs")
    return so


def from_response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise APIError(400, "json_schema is only for type json_schema", "response_format")
        return None
    if fmt.type == "json_object":
        so = StructuredOutputsParams(json_object=True)
        _checked(so, "response_format")
        return so
    if fmt.json_schema is None:
        raise APIError(
            400, "response_format.json_schema is required for type json_schema", "response_format"
        )
    schema = fmt.json_schema.schema_
    if schema is not None and fmt.json_schema.strict:
        schema = closed_schema(schema)
    # OpenAI's default when no schema is given: any JSON object.
    so = StructuredOutputsParams(json=schema if schema is not None else {"type": "object"})
    _checked(so, "response_format.json_schema", "response_format.json_schema.schema")
    return so


def combined(*parts: tuple[str, StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
    """The one constraint of a request; two sources at once is a 400 naming the second."""
    chosen: StructuredOutputsParams | None = None
    first = ""
    for field, so in parts:
        if so is None:
            continue
        if chosen is not None:
            raise APIError(400, f"{field} cannot be combined with {first}", field)
        chosen, first = so, field
    return chosen
