"""Batch API lines carry structured outputs and tools like the HTTP endpoints do (`batch
run` on a tiny random model: the grammar alone makes its answers valid), and a line with a
bad constraint is an error line naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "n"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"k": {"enum": ["a", "b"]}},
            "required": ["k"],
        },
    },
}


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_batch_lines_with_constraints_and_tools(tiny_llama: str, tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "answer me"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    lines = [
        _line("schema", "/v1/chat/completions", {"messages": chat, "response_format": fmt, "max_tokens": 40}),
        _line("choice", "/v1/chat/completions", {"messages": chat, "max_tokens": 8,
                                                 "structured_outputs": {"choice": ["left", "right"]}}),
        _line("tool", "/v1/chat/completions", {"messages": chat, "tools": [TOOL], "max_tokens": 40,
                                               "tool_choice": "required", "parallel_tool_calls": False}),
        _line("bad", "/v1/chat/completions", {"messages": chat, "structured_outputs": {"regex": "(("}}),
    ]  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "fleetserve.entrypoints.cli", "batch", "run", str(inp), "-o",
           str(out), "--model", tiny_llama, "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    body = got["schema"]["response"]["body"]
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
    choice = got["choice"]["response"]["body"]["choices"][0]
    assert choice["message"]["content"] in ("left", "right")
    tool_choice = got["tool"]["response"]["body"]["choices"][0]
    assert tool_choice["finish_reason"] == "tool_calls"
    (call,) = tool_choice["message"]["tool_calls"]
    assert (
        call["function"]["name"] == "pick"
        and json.loads(call["function"]["arguments"])["k"] in "ab"
    )
    err = got["bad"]["error"] or got["bad"]["response"]["body"]["error"]
    assert "structured_outputs.regex" in json.dumps(err)
