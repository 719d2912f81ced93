"""The step's LoRA rows, set around a forward by the model runner (like the attention
metadata in forward_context.py), so that model code keeps `forward(input_ids, positions)`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fleetserve.lora.kernel import RowGroups

_GROUPS: RowGroups | None = None


@contextlib.contextmanager
def set_lora_rows(groups: RowGroups | None) -> Iterator[None]:
    global _GROUPS
    prev, _GROUPS = _GROUPS, groups
    try:
        yield
    finally:
        _GROUPS = prev


def lora_rows() -> RowGroups | None:
    """This step's adapter rows by slot (None: every row is the base model's)."""
    return _GROUPS
