"""What a tool parser reads out of a model's text: plain content and function calls.

A parser is a pure function of the text so far (`parse(text, final)`), so streaming is
a diff between two parses (streaming.py): content that is surely not part of a call is
shown, a call's `arguments` grow as the model writes them. The JSON scanner below reads
incomplete JSON: while a call's arguments value is still open, every character of it so
far belongs to it, so the pieces streamed add up to the final arguments exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallState:
    name: str | None  # None until the name's string is complete
    arguments: str  # the raw JSON text of the arguments value so far
    done: bool = False  # the call's object is closed


@dataclass
class ParseState:
    content: str
    calls: list[CallState] = field(default_factory=list)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index past the JSON string starting at text[i] == '"' (None: not closed yet)."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index past the JSON value starting at text[i] (None: not complete yet)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def scan_call(text: str, i: int) -> tuple[CallState | None, int | None]:
    """The call object starting at text[i] == '{': {"name": ..., "arguments": ...} (or
    "parameters"). Returns the call so far (None when the object is not a call) and the
    index past it (None while it is open)."""
    assert text[i] == "{"
    call = CallState(None, "")
    j = skip_ws(text, i + 1)
    while True:
        if j >= len(text):
            return call, None
        if text[j] == "}":
            ok = call.name is not None
            call.done = True
            return (call if ok else None), j + 1
        if text[j] != '"':
            return None, None
        kend = string_end(text, j)
        if kend is None:
            return call, None
        try:
            key = json.loads(text[j:kend])
        except ValueError:
            return None, None
        j = skip_ws(text, kend)
        if j >= len(text):
            return call, None
        if text[j] != ":":
            return None, None
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return call, None
        vend = value_end(text, j)
        if key in NAME_KEYS:
            if vend is None:
                return call, None
            try:
                name = json.loads(text[j:vend])
            except ValueError:
                return None, None
            if not isinstance(name, str):
                return None, None
            call.name = name
        elif key in ARGUMENT_KEYS:
            call.arguments = text[j:vend] if vend is not None else text[j:]
            if vend is None:
                return call, None
        if vend is None:
            return call, None
        j = skip_ws(text, vend)
        if j >= len(text):
            return call, None
        if text[j] == ",":
            j = skip_ws(text, j + 1)
        elif text[j] != "}":
            return None, None


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (kept
    out of the content until the next characters tell)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def final_arguments(raw: str) -> str:
    """A finished call's arguments as OpenAI sends them: JSON text of an object. A model
    that wrote them as a JSON string holding JSON gets that string's content."""
    raw = raw.strip()
    if not raw:
        return "{}"
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, str):
        return value
    return raw


class ToolParser:
    """Reads calls out of one model's output format."""

    name = "base"
    # Special tokens the format uses that the detokenizer must keep (Mistral's
    # [TOOL_CALLS] is a special token).
    needs_special_tokens = False

    def parse(self, text: str, final: bool) -> ParseState:
        raise NotImplementedError
