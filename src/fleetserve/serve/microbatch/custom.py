"""User models behind `kind: custom`: a class named "package.module:ClassName" in the config.

Contract for the class: ``__init__(**options)`` loads whatever it needs (it runs once), and
``__call__(instances: list[dict]) -> list[dict]`` answers a batch, one prediction per
instance, in order. It runs in a process of its own (isolated.py), one call at a time.

How a handler fails one instance: raise (the batch is then re-run one instance at a time,
so only the instance that fails alone fails), or put an ``Exception`` in that instance's
slot. A ``ValueError`` means the instance was bad (HTTP 400); any other exception, or a
prediction that breaks the contract (wrong count, not a JSON object), is the handler's
fault (HTTP 500). The server never goes down for it: not for sys.exit, KeyboardInterrupt,
a hang (ended at the model's timeout_s: HTTP 504) or the death of the handler's process.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Instance = dict[str, Any]
Prediction = dict[str, Any]

_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def validate_instances(instances: Sequence[Any]) -> list[Instance]:
    """A predict request's instances, checked before they are queued (ValueError naming
    the field): at least one, each a JSON object."""
    if not instances:
        raise ValueError("instances must not be empty")
    for i, inst in enumerate(instances):
        if not isinstance(inst, dict):
            raise ValueError(f"instances[{i}] must be a JSON object")
    return list(instances)


class HandlerError(RuntimeError):
    """The handler broke its contract or raised something other than ValueError."""


@dataclass(frozen=True)
class HandlerSpec:
    module: str
    attr: str  # may be dotted: "Outer.Inner"

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"


def parse_handler_spec(spec: str) -> HandlerSpec:
    """Check the form of "package.module:ClassName" without importing anything (so a
    config can be validated before any model loads)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"handler must look like 'package.module:ClassName', got {spec!r}")
    module, attr = spec.split(":")
    if not _MODULE.fullmatch(module) or not _MODULE.fullmatch(attr):
        raise ValueError(
            f"handler {spec!r}: module and class must be dotted Python names "
            "('package.module:ClassName')"
        )
    return HandlerSpec(module, attr)


def load_handler(spec: str, options: dict[str, Any] | None = None) -> CustomModel:
    """Import the class, build it with `options` as keyword arguments, wrap it."""
    parsed = parse_handler_spec(spec)
    try:
        module = importlib.import_module(parsed.module)
    except ModuleNotFoundError as e:
        if e.name and (parsed.module == e.name or parsed.module.startswith(e.name + ".")):
            raise ValueError(f"handler {spec!r}: module {parsed.module!r} not found") from e
        raise ValueError(f"handler {spec!r}: importing {parsed.module!r} failed: {e}") from e
    target: Any = module
    for part in parsed.attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"handler {spec!r}: {parsed.module!r} has no {parsed.attr!r}")
        target = getattr(target, part)
    if not isinstance(target, type):
        raise ValueError(f"handler {spec!r} is a {type(target).__name__}, not a class")
    try:
        instance = target(**(options or {}))
    except TypeError as e:
        raise ValueError(f"options for handler {spec!r} do not fit its __init__: {e}") from e
    if not callable(instance):
        raise ValueError(f"handler {spec!r}: its instances are not callable (no __call__)")
    return CustomModel(str(parsed), instance)


class CustomModel:
    """A loaded handler with its output contract checked on every call."""

    def __init__(self, spec: str, handler: Callable[[list[Instance]], Any]) -> None:
        self.spec = spec
        self.handler = handler

    def __call__(self, instances: list[Instance]) -> list[Prediction | Exception]:
        """Raises for a failed batch (the batcher re-runs its instances alone); an
        Exception in a slot fails that instance only."""
        try:
            predictions = self.handler(instances)
        except ValueError:
            raise  # a bad instance: the batcher isolates it and it becomes a 400
        except Exception as e:
            raise HandlerError(f"handler {self.spec} raised {type(e).__name__}: {e}") from e
        if not isinstance(predictions, (list, tuple)):
            raise HandlerError(
                f"handler {self.spec} returned a {type(predictions).__name__}, "
                "not a list of predictions"
            )
        if len(predictions) != len(instances):
            raise HandlerError(
                f"handler {self.spec} returned {len(predictions)} predictions for "
                f"{len(instances)} instances"
            )
        return [self._check(p) for p in predictions]

    def _check(self, prediction: Any) -> Prediction | Exception:
        if isinstance(prediction, Exception):
            return prediction
        if not isinstance(prediction, dict):
            return HandlerError(
                f"handler {self.spec} returned a {type(prediction).__name__} as a "
                "prediction, not a JSON object (dict)"
            )
        try:
            # Refuse here what the HTTP response could not encode, before a client waits on it.
            json.dumps(prediction, allow_nan=False)
        except (TypeError, ValueError) as e:
            return HandlerError(f"handler {self.spec} returned a non-JSON prediction: {e}")
        return prediction
