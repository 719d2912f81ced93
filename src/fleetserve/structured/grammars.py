"""A request's constraint as an llguidance grammar, and its validation with errors that
name the offending field (for a JSON schema: the path inside it).

llguidance was measured against xgrammar and outlines-core on SmolLM2's vocabulary
(docs/benchmarks.md, "Structured outputs"): it compiles a realistic schema in a few ms,
computes a mask in tens of microseconds, reads Lark and GBNF grammars, rolls back (for
rejected drafts), and is one dependency-free wheel.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from fleetserve.core.structured import StructuredOutputsParams

# Compact separators and no free whitespace: a small model given free whitespace can
# emit newlines until max_tokens; "," / ":" (and ", " / ": ") are what models write.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# Grammar text -> "" (valid) or its error; validation is cheap but not free.
_CHECKED: OrderedDict[str, str] = OrderedDict()
_CHECKED_MAX = 256


def _schema(value: dict[str, Any] | str, field: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON schema (an object)")
    return value


def grammar_text(params: StructuredOutputsParams, field: str = "structured_outputs") -> str:
    """The llguidance grammar (JSON text) for `params`; not yet checked."""
    kind = params.kind
    if kind == "json":
        assert params.json is not None
        schema = _schema(params.json, f"{field}.json")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS
        )
    if kind == "regex":
        assert params.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    assert params.grammar is not None
    return llguidance.grammar_from("grammar", params.grammar)


def _error_of(grammar: str) -> str:
    err = _CHECKED.get(grammar)
    if err is None:
        err = llguidance.LLMatcher.validate_grammar(grammar)
        _CHECKED[grammar] = err
        if len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)
    else:
        _CHECKED.move_to_end(grammar)
    return err


def check(
    params: StructuredOutputsParams,
    field: str = "structured_outputs",
    json_field: str | None = None,
) -> str:
    """The grammar text of `params`, or ValueError naming the field (a schema's error
    names the JSON path of the deepest sub-schema that fails on its own, below
    `json_field`, by default `{field}.json`)."""
    json_field = json_field or f"{field}.json"
    try:
        grammar = grammar_text(params, field)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from e
    err = _error_of(grammar)
    if not err:
        return grammar
    kind = params.kind
    if kind == "json":
        assert params.json is not None
        schema = _schema(params.json, json_field)
        path = _failing_path(schema, schema)
        where = ".".join([json_field, *path])
        raise ValueError(f"{where}: the JSON schema cannot be compiled: {_first_line(err)}")
    if kind == "regex":
        raise ValueError(f"{field}.regex does not compile: {err.strip()}")
    raise ValueError(f"{field}.{kind} does not compile: {err.strip()}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _children(schema: dict[str, Any]) -> list[tuple[list[str], Any]]:
    out: list[tuple[list[str], Any]] = []
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        sub = schema.get(key)
        if isinstance(sub, dict):
            out.extend(([key, str(name)], s) for name, s in sub.items())
    for key in ("items", "additionalProperties", "not", "contains", "propertyNames"):
        if isinstance(schema.get(key), dict):
            out.append(([key], schema[key]))
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        sub = schema.get(key)
        if isinstance(sub, list):
            out.extend(([key, str(i)], s) for i, s in enumerate(sub))
    return out


def _failing_path(schema: Any, root: dict[str, Any]) -> list[str]:
    """The path below `schema` of the deepest sub-schema that fails to compile alone (with
    the root's definitions, so that references still resolve)."""
    if not isinstance(schema, dict):
        return []
    for path, child in _children(schema):
        if not isinstance(child, dict):
            return path if child is not True and child is not False else []
        probe = dict(child)
        for defs in ("$defs", "definitions"):
            if defs in root and defs not in probe:
                probe[defs] = root[defs]
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(probe, defaults=JSON_OPTIONS)
        except ValueError:
            return path
        if _error_of(g):
            return path + _failing_path(child, root)
    return []


def closed_schema(schema: Any) -> Any:
    """`schema` with every object that lists its properties but says nothing of others
    closed to them (additionalProperties: false), as OpenAI's strict mode requires them to
    be. A small model given open objects adds keys until max_tokens; the answers still
    validate against the original schema."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}  # fmt: skip
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_schema(v) for name, v in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out
