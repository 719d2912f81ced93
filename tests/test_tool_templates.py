"""A chat template that renders tools gets them from `apply_chat_template(tools=...)`,
with the assistant's earlier calls (arguments as objects, as HF templates expect) and
`role: "tool"` results; one that cannot render tools gets fleetserve's Hermes prompt."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from transformers import AutoTokenizer

from fleetserve.entrypoints.openai.protocol import ChatCompletionRequest
from fleetserve.entrypoints.openai.serving_chat import _prompt_ids
from fleetserve.entrypoints.openai.tool_parsers import parser_for_template
from fleetserve.tokenizer import Tokenizer

# A Hermes-style template (the shape Qwen 2.5's has): tools as JSON lines in the system
# turn, calls as <tool_call> JSON with `arguments` an object, results as <tool_response>.
TEMPLATE = (
    "{%- if tools %}<|system|>Tools:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{%- endif %}'
    "{%- for m in messages %}\n<|{{ m.role }}|>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor %}"
    "{%- if m.role == 'tool' %} (for {{ m.tool_call_id }}){%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|assistant|>{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}


def _render(tok: Tokenizer, body: dict[str, Any]) -> str:
    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok, max_model_len=4096))
    req = ChatCompletionRequest.model_validate({"model": "m", **body})
    return tok.decode(_prompt_ids(ctx, req))  # type: ignore[arg-type]


def test_a_template_that_renders_tools_gets_them(tiny_llama: str) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_llama)
    hf.chat_template = TEMPLATE
    tok = Tokenizer(hf)
    assert parser_for_template(TEMPLATE) == "hermes"
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    text = _render(tok, {"messages": messages, "tools": [WEATHER]})
    system = text.split("<|user|>")[0]
    assert system.startswith("<|system|>Tools:")  # the template's own tool section
    rendered = system[len("<|system|>Tools:") : system.index("Call one as")]
    assert json.loads(rendered) == WEATHER
    # The call went to the template with its arguments as an object, not a JSON string.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|tool|>18 C (for call_1)" in text
    assert "You can call functions" not in text  # not fleetserve's own tool prompt
    assert text.endswith("<|tool|>18 C (for call_1)<|assistant|>")


def test_a_template_without_tools_gets_fleetserves_prompt(tiny_llama: str) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_llama)
    hf.chat_template = (
        "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{%- endfor %}<|assistant|>"
    )
    tok = Tokenizer(hf)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    text = _render(tok, {"messages": messages, "tools": [WEATHER]})
    assert text.startswith("<|system|>You can call functions")
    assert '"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    assert "<|user|><tool_response>\n18 C\n</tool_response>" in text
