"""The small mapping language between a graph's steps (serve/pipelines/graph*.py).

A step's `input:` is a template of the body its model is called with. Every string in it
is read once, at load:

- `"$request.messages"`: a selector, the whole string; the selected value itself (any
  type). Roots: `$request` (the body the graph was called with), `$input` (what the step
  gets by default: the previous step's output in a sequence, the node's input elsewhere),
  `$steps.NAME` (the output of the step called NAME). Then `.key` and `[index]` (negative
  from the end) steps: `$steps.retrieve.predictions[0].text`, `$request.messages[-1]`.
- `"Context: {$steps.docs.predictions[0]}\\nQuestion: {$request.q}"`: a string template;
  each `{$...}` is replaced by the selected value (a string as is, anything else as JSON).
- `"$$5"`: the literal string "$5" (a leading `$$` escapes); any other string, number,
  bool or null is itself. Mappings and lists are templates of their items.

A switch step's `when:` is `"$selector"` (the value is truthy), `"$selector OP VALUE"`
with OP one of == != < <= > >= in, `not in`, =~ (a regex search) and VALUE a YAML
scalar or list (`spam`, `3`, `[a, b]`) or another selector, or `package.module:function`
called with (request, input, steps). A selector whose path is missing reads None in a
condition and is an error (400, naming the step and path) in an input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

ROOTS = ("request", "input", "steps")
_KEY = r"[A-Za-z_][\w-]*"
_PATH = re.compile(rf"\$(?P<root>{_KEY})(?P<path>(?:\.{_KEY}|\[-?\d+\])*)")
_PART = re.compile(rf"\.({_KEY})|\[(-?\d+)\]")
_FUNCTION = re.compile(r"^[\w.]+:[\w.]+$")
_OPS = ("==", "!=", "<=", ">=", "<", ">", "=~", "not in", "in")
_CONDITION = re.compile(rf"^(\$\S+)\s+({'|'.join(re.escape(o) for o in _OPS)})\s+(.+)$", re.S)


class MissingValue(LookupError):
    """A selector's path is not in the data (the request lacks the field)."""


@dataclass(frozen=True)
class Scope:
    """What a step's templates and conditions read."""

    request: Any
    input: Any
    steps: Mapping[str, Any]


@dataclass(frozen=True)
class Selector:
    text: str
    root: str
    path: tuple[str | int, ...]

    @property
    def step(self) -> str | None:
        """The step a `$steps.NAME...` selector reads."""
        return str(self.path[0]) if self.root == "steps" else None

    @property
    def whole(self) -> bool:
        """It selects a whole value ($request, $input, $steps.NAME), not a part of one."""
        return len(self.path) == (1 if self.root == "steps" else 0)

    def read(self, scope: Scope) -> Any:
        if self.root == "steps":
            if self.path[0] not in scope.steps:
                raise MissingValue(f"{self.text}: the step {self.path[0]!r} has not run")
            value, rest = scope.steps[str(self.path[0])], self.path[1:]
        else:
            value, rest = getattr(scope, self.root), self.path
        for part in rest:
            try:
                if isinstance(part, int) and not isinstance(value, list):
                    raise TypeError
                value = value[part]
            except (KeyError, IndexError, TypeError):
                raise MissingValue(f"{self.text}: no {part!r} in the value") from None
        return value


def parse_selector(text: str) -> Selector:
    """`$root.a[0].b` -> a Selector; ValueError saying what is wrong."""
    m = _PATH.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a selector ($request, $input or $steps.NAME, then "
                         ".key and [index] steps)")  # fmt: skip
    if m["root"] not in ROOTS:
        raise ValueError(f"{text!r}: the root is ${m['root']}; roots are $request, $input, "
                         "$steps.NAME")  # fmt: skip
    path: list[str | int] = []
    for p in _PART.finditer(m["path"]):
        path.append(p[1] if p[1] is not None else int(p[2]))
    if m["root"] == "steps" and (not path or not isinstance(path[0], str)):
        raise ValueError(f"{text!r}: $steps is followed by a step's name ($steps.NAME)")
    return Selector(text, m["root"], tuple(path))


# A compiled template: scope -> value.
Template = Callable[[Scope], Any]


def _interpolate(parts: list[str | Selector]) -> Template:
    def render(scope: Scope) -> str:
        out = []
        for p in parts:
            if isinstance(p, str):
                out.append(p)
            else:
                v = p.read(scope)
                out.append(v if isinstance(v, str) else json.dumps(v))
        return "".join(out)

    return render


def _string(text: str, found: list[Selector]) -> Template:
    if text.startswith("$$"):
        literal = text[1:]
        return lambda scope: literal
    if text.startswith("$") and "{$" not in text:
        sel = parse_selector(text)
        found.append(sel)
        return sel.read
    if "{$" not in text:
        return lambda scope: text
    parts: list[str | Selector] = []
    pos = 0
    for m in re.finditer(r"\{(\$[^{}]*)\}", text):
        parts.append(text[pos : m.start()])
        sel = parse_selector(m[1])
        found.append(sel)
        parts.append(sel)
        pos = m.end()
    parts.append(text[pos:])
    return _interpolate(parts)


def compile_template(value: Any, found: list[Selector] | None = None) -> Template:
    """The template of `value` (see the module doc); `found` collects its selectors.
    ValueError naming the bad string."""
    found = [] if found is None else found
    if isinstance(value, str):
        return _string(value, found)
    if isinstance(value, dict):
        items = [(str(k), compile_template(v, found)) for k, v in value.items()]
        return lambda scope: {k: t(scope) for k, t in items}
    if isinstance(value, list):
        seq = [compile_template(v, found) for v in value]
        return lambda scope: [t(scope) for t in seq]
    if value is None or isinstance(value, bool | int | float):
        return lambda scope: value
    raise ValueError(f"{value!r}: a template holds strings, numbers, bools, null, lists, maps")


def selectors_of(value: Any) -> list[Selector]:
    found: list[Selector] = []
    compile_template(value, found)
    return found


def is_function(text: str) -> bool:
    return bool(_FUNCTION.match(text))


def _compare(op: str, left: Any, right: Any) -> bool:
    try:
        if op == "==":
            return bool(left == right)
        if op == "!=":
            return bool(left != right)
        if op == "in":
            return right is not None and left in right
        if op == "not in":
            return right is None or left not in right
        if op == "=~":
            return isinstance(left, str) and re.search(str(right), left) is not None
        if left is None or right is None:
            return False
        return bool({"<": left < right, "<=": left <= right, ">": left > right,
                     ">=": left >= right}[op])  # fmt: skip
    except TypeError:
        return False


def _read_or_none(sel: Selector, scope: Scope) -> Any:
    try:
        return sel.read(scope)
    except MissingValue:
        return None


@dataclass(frozen=True)
class Condition:
    """A switch step's `when:` (see the module doc)."""

    text: str
    left: Selector | None
    op: str | None
    right: Selector | None
    value: Any
    function: str | None

    @property
    def selectors(self) -> list[Selector]:
        return [s for s in (self.left, self.right) if s is not None]

    def holds(self, scope: Scope, function: Callable[..., Any] | None = None) -> bool:
        if self.function is not None:
            assert function is not None  # the service imported it
            return bool(function(scope.request, scope.input, dict(scope.steps)))
        assert self.left is not None
        left = _read_or_none(self.left, scope)
        if self.op is None:
            return bool(left)
        right = _read_or_none(self.right, scope) if self.right is not None else self.value
        return _compare(self.op, left, right)


def parse_condition(text: str) -> Condition:
    """`when:` -> a Condition; ValueError saying what is wrong."""
    text = text.strip()
    if is_function(text):
        return Condition(text, None, None, None, None, text)
    if not text.startswith("$"):
        raise ValueError(f"{text!r}: a condition is '$selector', '$selector OP VALUE' (OP one "
                         f"of {', '.join(_OPS)}) or 'package.module:function'")  # fmt: skip
    m = _CONDITION.match(text)
    if m is None:
        return Condition(text, parse_selector(text), None, None, None, None)
    left, op, rest = parse_selector(m[1]), m[2], m[3].strip()
    if rest.startswith("$"):
        return Condition(text, left, op, parse_selector(rest), None, None)
    try:
        value = yaml.safe_load(rest)
    except yaml.YAMLError:
        raise ValueError(f"{text!r}: {rest!r} is not a YAML value") from None
    if op == "=~":
        try:
            re.compile(str(value))
        except re.error as e:
            raise ValueError(f"{text!r}: not a valid regex: {e}") from None
    if op in ("in", "not in") and not isinstance(value, list | str | dict):
        raise ValueError(f"{text!r}: `{op}` needs a list, a string or a mapping on the right")
    return Condition(text, left, op, None, value, None)
