"""Start-up lines the user should see once per process (the dtype `--dtype auto` picked,
whether int8 activations are on), shown even where logging is unconfigured (the offline
`LLM`, a script): then the logger gets its own stderr handler, `fleetserve: <message>`."""

from __future__ import annotations

import logging
from collections.abc import Hashable


def say_once(log: logging.Logger, said: set[Hashable], key: Hashable, message: str) -> None:
    """Log `message` at INFO on `log` unless `key` is in `said` already (then add it)."""
    if key in said:
        return
    said.add(key)
    if not logging.getLogger().hasHandlers() and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("fleetserve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.info("%s", message)
