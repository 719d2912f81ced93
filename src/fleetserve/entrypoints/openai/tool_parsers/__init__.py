"""Tool-call parsers per model output format, chosen by name (`tool_parser:` in the
fleet file, `--tool-parser`) or by what the chat template writes."""

from __future__ import annotations

from fleetserve.entrypoints.openai.tool_parsers.base import (
    CallState,
    ParseState,
    ToolParser,
    final_arguments,
)
from fleetserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from fleetserve.entrypoints.openai.tool_parsers.json_calls import (
    JsonToolParser,
    Llama3JsonToolParser,
)
from fleetserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "json": JsonToolParser,
}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template implies. A template that cannot render tools gets
    fleetserve's own tool prompt, in the Hermes format."""
    t = template or ""
    if "tools" not in t or "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "json"


def make_parser(name: str, function_names: set[str] | None = None) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool_parser must be one of {sorted(PARSERS)}, got {name!r}")
    cls = PARSERS[name]
    if issubclass(cls, JsonToolParser):
        return cls(function_names)
    return cls()


__all__ = [
    "PARSERS",
    "CallState",
    "ParseState",
    "ToolParser",
    "final_arguments",
    "make_parser",
    "parser_for_template",
]
