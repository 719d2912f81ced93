"""Custom-model handlers for the fleet tests ("fleet_handlers:Classifier" in a config)."""

from __future__ import annotations

from typing import Any


class Classifier:
    """Labels a text by its length; raises ValueError for the text `fail_on` (a bad
    instance), which fails the whole batch it is in. Logs each batch it is given."""

    def __init__(self, labels: list[str], fail_on: str = "boom") -> None:
        if not labels:
            raise ValueError("labels must not be empty")
        self.labels = labels
        self.fail_on = fail_on
        self.batches: list[list[dict[str, Any]]] = []

    def __call__(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.batches.append(instances)
        out = []
        for inst in instances:
            text = inst.get("text")
            if not isinstance(text, str) or text == self.fail_on:
                raise ValueError(f"cannot classify {text!r}")
            label = self.labels[len(text) % len(self.labels)]
            out.append({"label": label, "length": len(text)})
        return out


class Crashy:
    """Fails the instance {"crash": true} with a non-ValueError (a handler bug: 500)."""

    def __call__(self, instances: list[dict[str, Any]]) -> list[Any]:
        return [ZeroDivisionError("crash") if i.get("crash") else {"ok": True} for i in instances]


class WrongLength:
    def __call__(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"ok": True}] * (len(instances) + 1)


class NotAList:
    def __call__(self, instances: list[dict[str, Any]]) -> dict[str, Any]:
        return {"ok": True}


class BadPredictions:
    """A set is not JSON; a string is not a JSON object."""

    def __call__(self, instances: list[dict[str, Any]]) -> list[Any]:
        return [{"s": {1, 2}} if i.get("set") else "not a dict" for i in instances]


class NotCallable:
    pass


NOT_A_CLASS = 42


def not_a_class(instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return instances


class AnyOptions:
    """Takes any options (a stand-in for an example's handler that is not installed here);
    echoes each instance with the options it was given."""

    def __init__(self, **options: Any) -> None:
        self.options = options

    def __call__(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"instance": i, "options": self.options} for i in instances]
