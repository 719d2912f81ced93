"""Per-step attention metadata, entered once around a model forward.

Attention layers read it through ``get_forward_context()`` so that model code keeps
the plain ``forward(input_ids, positions)`` signature.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class DecodeGroup:
    """Decode rows ``start:end`` with block tables padded to the group's longest."""

    start: int
    end: int
    block_table: torch.Tensor  # [num_rows, max_num_blocks]
    kv_mask: torch.Tensor  # [num_rows, 1, 1, max_num_blocks * block_size] bool


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache.

    Requests are laid out back to back in the flattened batch: request i owns rows
    ``query_start_loc[i]:query_start_loc[i + 1]``. Decode requests (one new token) come
    first so that they can be attended in one batched call.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot each new token is written to
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs] tokens with K/V after this step
    context_lens: list[int]  # [num_reqs] tokens with K/V before this step
    num_decodes: int  # leading requests with exactly one new token and some context
    block_size: int
    # Decodes, in groups of similar length attended in one padded batch each.
    decode_groups: list[DecodeGroup]
    # Prefill requests that have cached context: their block tables (None: no context).
    prefill_block_tables: list[torch.Tensor | None]  # [num_reqs - num_decodes]


_CONTEXT: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(meta: AttentionMetadata | None) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, meta
    try:
        yield
    finally:
        _CONTEXT = prev


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return _CONTEXT
