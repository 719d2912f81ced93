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
class PagedSeqs:
    """Requests attended straight from the paged cache by the CPU kernel: every request
    of the step, in the batch's order (decodes and prefill chunks)."""

    q_starts: torch.Tensor  # int64 [n] first query row in the flat batch
    q_lens: torch.Tensor  # int64 [n]
    seq_lens: torch.Tensor  # int64 [n] tokens in the cache after this step's write
    block_tables: torch.Tensor  # int64 [n, max_num_blocks], padded with block 0


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache.

    The caches are ``[num_blocks, num_kv_heads, block_size, head_dim]`` per layer (on the
    CPU kernel path the key cache is ``[num_blocks, num_kv_heads, head_dim, block_size]``,
    see ``kernels.cpu.kv_cache_shapes``).
    Requests are laid out back to back in the flattened batch: request i owns rows
    ``query_start_loc[i]:query_start_loc[i + 1]``. Decode requests (one new token) come
    first so that the plain-torch path can attend them in batched calls.
    """

    slot_blocks: torch.Tensor  # [num_tokens] block each new token's K/V is written to
    slot_offsets: torch.Tensor  # [num_tokens] offset within that block
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs] tokens with K/V after this step
    context_lens: list[int]  # [num_reqs] tokens with K/V before this step
    num_decodes: int  # leading requests with exactly one new token and some context
    block_size: int
    # CPU kernel path (None: the plain-torch path, below).
    paged: PagedSeqs | None
    # Plain-torch path: decodes in groups of similar length attended in one padded
    # batch each, and the block tables of prefills with cached context (None: none).
    decode_groups: list[DecodeGroup]
    prefill_block_tables: list[torch.Tensor | None]  # [num_reqs - num_decodes]
    # float32 on the CPU with the C kernels built: norms, rotary, silu*mul and the
    # cache write run as fused C calls too (fleetserve/kernels/fused_ops.c).
    cpu_kernels: bool = False
    # The sliding-window layers' own slots and block tables, when the engine keeps a
    # separate block table for them (a model with local and global layers); None: the
    # sliding-window layers (if any) use this metadata.
    sliding: AttentionMetadata | None = None
    # The rows whose logits the caller samples (distinct, in the order it wants them),
    # set before the forward; None: the caller computes them from the hidden states. A
    # forward whose C step ran the LM head leaves its raw output for those rows in
    # `head_logits` (models/llama_decode.py; before any gather of TP vocab shards).
    logit_rows: list[int] | None = None
    head_logits: torch.Tensor | None = None
    # Set before the forward: the C step also finds each head row's argmax (the caller's
    # logits are the head's output unchanged, so that is their argmax), left in
    # `head_argmax` (int64 [len(logit_rows)]; None: not found).
    want_head_argmax: bool = False
    head_argmax: torch.Tensor | None = None
    # Set before the forward: nothing reads the hidden states of rows outside
    # `logit_rows` (no prompt logprobs): the C step may leave them out of its last
    # layer's o projection and MLP (kernels/decode_step.py, DecodePlan.run).
    sampled_rows_only: bool = False


_CONTEXT: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(meta: AttentionMetadata | None) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, meta
    try:
        yield
    finally:
        _CONTEXT = prev


def cpu_kernels_active() -> bool:
    """Whether the current forward runs the fused C kernels (False outside a forward)."""
    return _CONTEXT is not None and _CONTEXT.cpu_kernels


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return _CONTEXT
