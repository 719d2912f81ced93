"""Custom-model handlers for the fleet tests ("fleet_handlers:Classifier" in a config)."""

from __future__ import annotations

import json
from typing import Any


class Classifier:
    """Labels a text by its length; raises ValueError for the text `fail_on` (a bad
    instance), which fails the whole batch it is in. Logs each batch it is given."""

    def __init__(self, labels: list[str], fail_on: str = "boom", log: str | None = None) -> None:
        if not labels:
            raise ValueError("labels must not be empty")
        self.labels = labels
        self.fail_on = fail_on
        self.log = log  # a file each batch is appended to (one JSON line), for tests
        self.batches: list[list[dict[str, Any]]] = []

    def __call__(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.batches.append(instances)
        if self.log is not None:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(json.dumps(instances) + "\n")
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


class Misbehaves:
    """Does to the server what a handler could: per instance, {"exit": code} calls
    sys.exit, {"interrupt": true} raises KeyboardInterrupt, {"base": true} a bare
    BaseException, {"sleep": s} hangs for s seconds, {"os_exit": code} ends its process,
    {"alloc_mb": n} allocates n MB; anything else answers with the process's pid."""

    def __call__(self, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        import os
        import sys
        import time

        out = []
        for inst in instances:
            if "exit" in inst:
                sys.exit(inst["exit"])
            if inst.get("interrupt"):
                raise KeyboardInterrupt
            if inst.get("base"):
                raise BaseException("a bare BaseException")
            if "sleep" in inst:
                time.sleep(inst["sleep"])
            if "os_exit" in inst:
                os._exit(inst["os_exit"])
            if "alloc_mb" in inst:
                block = bytearray(inst["alloc_mb"] * 2**20)
                out.append({"allocated": len(block)})
                continue
            out.append({"pid": os.getpid()})
        return out
