"""A tokenizer read straight from a folder's files (tokenizer.json, tokenizer_config.json,
special_tokens_map.json, chat_template.jinja) with the `tokenizers` library and jinja2,
without importing transformers.

Why: the API process needs a tokenizer at start-up, and transformers' AutoTokenizer costs
~1.7 s of CPU there (the package, then its config machinery) on top of torch, which it
pulls in too. `FilesTokenizer` answers the part of the transformers tokenizer API that
fleetserve.tokenizer.Tokenizer calls, with the same results for the folders it takes
(tests/test_tokenizer_files.py compares it with AutoTokenizer on every model family the
project builds, SmolLM2's and Gemma 3's GGUF conversions included). `load` returns None
for a folder it cannot promise that for (no tokenizer.json, a tokenizer class with its
own Python logic, a model type whose AutoTokenizer class rebuilds the pipeline); the
caller then uses transformers.

Chat templates render as transformers renders them: a sandboxed jinja2 environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` that keeps
non-ASCII text, `raise_exception` and `strftime_now`; the messages copied to plain JSON
data with their reasoning fields aliased (`reasoning_content`, `thinking`, `reasoning`);
the special tokens (`bos_token`, `eos_token`, ...) passed as variables.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cache, cached_property
from typing import Any

# What tokenizer_config.json may name for the plain tokenizers-backed class (Gemma's
# loads its tokenizer.json as it is: checked on Gemma 3's GGUF conversion in the tests).
_PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast", "GemmaTokenizer"})
# config.json model types whose AutoTokenizer class is the plain one (checked in the tests);
# others (Qwen2's, which rebuilds its normalizer and pre-tokenizer) go through transformers.
_PLAIN_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "gemma3", "gemma3_text"}
)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # fmt: skip
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _content(token: Any) -> str | None:
    """A special token as the config writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def load(folder: str) -> FilesTokenizer | None:
    """The folder's tokenizer without transformers, or None where transformers' own class
    would differ from the files' pipeline (the caller loads it with transformers then)."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    if config.get("tokenizer_class") not in _PLAIN_CLASSES:
        return None
    # A config that sets these makes transformers rewrite the post-processor; not ours.
    if any(k in config for k in ("add_bos_token", "add_eos_token", "split_special_tokens")):
        return None
    model_type = _read_json(os.path.join(folder, "config.json")).get("model_type")
    if model_type is not None and model_type not in _PLAIN_MODEL_TYPES:
        return None
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(path)
    template_path = os.path.join(folder, "chat_template.jinja")
    template: str | None
    if os.path.isfile(template_path):
        with open(template_path, encoding="utf-8") as f:
            template = f.read()
    else:
        found = config.get("chat_template")
        if found is not None and not isinstance(found, str):
            return None  # named templates (a list): transformers picks among them
        template = found
    specials = {**_read_json(os.path.join(folder, "special_tokens_map.json")), **config}
    return FilesTokenizer(folder, backend, specials, template,
                          bool(config.get("clean_up_tokenization_spaces", False)))  # fmt: skip


class FilesTokenizer:
    """The transformers tokenizer calls fleetserve.tokenizer.Tokenizer makes, over a
    `tokenizers.Tokenizer` (see the module's docstring)."""

    is_fast = True

    def __init__(
        self,
        folder: str,
        backend: Any,
        config: dict[str, Any],
        chat_template: str | None,
        clean_up_spaces: bool,
    ) -> None:
        self.folder = folder
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            content = _content(config.get(name))
            if content is not None:
                self.special_tokens_map[name] = content
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        self._extra = [c for c in (_content(t) for t in extra or ()) if c is not None]
        self._clean_up = clean_up_spaces and type(backend.model).__name__ != "BPE"

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    @cached_property
    def all_special_ids(self) -> list[int]:
        tokens = [*self.special_tokens_map.values(), *self._extra]
        ids = [self.backend_tokenizer.token_to_id(t) for t in dict.fromkeys(tokens)]
        return [i for i in ids if i is not None]

    def get_added_vocab(self) -> dict[str, int]:
        decoder = self.backend_tokenizer.get_added_tokens_decoder()
        return {token.content: int(i) for i, token in decoder.items()}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = self.backend_tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens
        )
        return _clean_up(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError("a chat template needs at least one message")
        # Keys whose value is None are dropped (OpenAI's content=None next to tool_calls):
        # templates handle a missing key, not a None.
        chat = [_alias_reasoning(_without_none(m)) for m in _plain(messages)]
        text = _compiled(self.chat_template).render(
            messages=chat,
            tools=_plain(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _clean_up(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and in English contractions
    (WordPiece tokenizers that ask for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                 (" 're", "'re")):  # fmt: skip
        text = text.replace(a, b)
    return text


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (what a sandboxed template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _without_none(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    return {k: v for k, v in message.items() if v is not None}


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@cache
def _compiled(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore-prefixed attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the attribute {name!r} on a namespace"
                )

    class PlainDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's
        part for training masks): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=PlainDict(), namespace=Namespace)  # fmt: skip
    return env.from_string(template)
