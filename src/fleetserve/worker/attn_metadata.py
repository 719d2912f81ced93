"""Attention metadata for one forward over a flattened batch of sequences.

Shared by the model runner and the draft-model proposer (spec_decode/), whose forwards
lay sequences out the same way: decodes (one query token with context) first.
"""

from __future__ import annotations

import numpy as np
import torch

from fleetserve.forward_context import AttentionMetadata, DecodeGroup, PagedSeqs
from fleetserve.worker.block_table import BlockTable


def build_attention_metadata(
    block_tables: list[list[int]],
    ctx_lens: list[int],
    q_lens: list[int],
    num_decodes: int,
    block_size: int,
    device: torch.device,
    cpu_kernels: bool,
    decode_group_size: int = 16,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Sequence i attends with ``ctx_lens[i]`` tokens already cached and ``q_lens[i]`` new
    ones (positions ``ctx .. ctx + q - 1``); the first ``num_decodes`` have q_len 1 and
    some context (on the plain-torch path attended in padded groups of at most
    ``decode_group_size``, sorted by length by the caller). Returns the metadata and the positions tensor [num_tokens]."""
    bs = block_size
    dev = device
    qsl = [0]
    seq_lens: list[int] = []
    positions: list[int] = []
    slot_blocks: list[int] = []
    for ids, c, n in zip(block_tables, ctx_lens, q_lens, strict=True):
        qsl.append(qsl[-1] + n)
        seq_lens.append(c + n)
        positions.extend(range(c, c + n))
        # Where each new token's K/V goes: (block, offset within it).
        slot_blocks.extend(ids[p // bs] for p in range(c, c + n))
    nd = num_decodes
    paged = None
    decode_groups: list[DecodeGroup] = []
    prefill_tables: list[torch.Tensor | None] = []
    if cpu_kernels:
        # The C kernel attends every sequence from the cache, prefill chunks without
        # context included (their K/V are written before attention runs). Every int64
        # array of the step in one tensor, handed out as views: one tensor built a step
        # (each torch call costs ~10x its warm time right after a step's weights went
        # through the caches).
        nblk = -(-max(seq_lens) // bs)
        m, n = len(positions), len(q_lens)
        flat = positions + slot_blocks + [p % bs for p in positions]
        flat += qsl[:-1] + list(q_lens) + seq_lens
        for ids in block_tables:
            row = ids[:nblk]
            flat += row
            flat += [0] * (nblk - len(row))
        every = torch.tensor(flat, dtype=torch.long)
        pos_t, blocks_t, offsets_t = every[:m], every[m : 2 * m], every[2 * m : 3 * m]
        o = 3 * m
        paged = PagedSeqs(
            q_starts=every[o : o + n],
            q_lens=every[o + n : o + 2 * n],
            seq_lens=every[o + 2 * n : o + 3 * n],
            block_tables=every[o + 3 * n :].view(n, nblk),
        )
    else:
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        blocks_t = torch.tensor(slot_blocks, dtype=torch.long, device=dev)
        offsets_t = pos_t % bs
        for start in range(0, nd, decode_group_size):
            end = min(start + decode_group_size, nd)
            nblk = -(-max(seq_lens[start:end]) // bs)
            # Padding entries point at block 0; the mask hides them.
            rows = [ids[:nblk] + [0] * (nblk - len(ids)) for ids in block_tables[start:end]]
            lens = torch.tensor(seq_lens[start:end], device=dev)
            mask = torch.arange(nblk * bs, device=dev)[None, :] < lens[:, None]
            decode_groups.append(
                DecodeGroup(
                    start,
                    end,
                    torch.tensor(rows, dtype=torch.long, device=dev),
                    mask[:, None, None, :],
                )
            )
        for i in range(nd, len(block_tables)):
            # Without context SDPA's causal path needs no table, but a sliding-window or
            # softcapped layer attends every chunk through it.
            prefill_tables.append(torch.tensor(block_tables[i], dtype=torch.long, device=dev))
    meta = AttentionMetadata(
        slot_blocks=blocks_t,
        slot_offsets=offsets_t,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        context_lens=list(ctx_lens),
        num_decodes=nd,
        block_size=bs,
        paged=paged,
        decode_groups=decode_groups,
        prefill_block_tables=prefill_tables,
        cpu_kernels=cpu_kernels,
    )
    return meta, pos_t


def build_cpu_metadata(
    table: BlockTable,
    rows: np.ndarray,
    ctx_lens: list[int],
    q_lens: list[int],
    num_decodes: int,
    block_size: int,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """`build_attention_metadata` for the CPU kernels (the same values, bit for bit),
    gathered by numpy from the runner's `table`: sequence i's block ids are row `rows[i]`
    (int64 [num_seqs]). One int64 array a step, handed out as tensor views."""
    bs = block_size
    n = len(q_lens)
    ctx = np.array(ctx_lens, dtype=np.int64)
    q = np.array(q_lens, dtype=np.int64)
    seq = ctx + q
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    m = int(qsl[-1])
    nblk = -(-int(seq.max()) // bs)
    every = np.empty(3 * m + 3 * n + n * nblk, dtype=np.int64)
    pos, blocks, offsets = every[:m], every[m : 2 * m], every[2 * m : 3 * m]
    if m == n:  # one row per sequence (decodes): its position is its context length
        pos[:] = ctx
        token_rows = rows
    else:  # row j of sequence i sits at position ctx[i] + (j - qsl[i])
        np.subtract(np.arange(m, dtype=np.int64), np.repeat(qsl[:-1] - ctx, q), out=pos)
        token_rows = np.repeat(rows, q)
    # Where each new token's K/V goes: (block, offset within it).
    np.floor_divide(pos, bs, out=offsets)
    blocks[:] = table.table[token_rows, offsets]
    np.remainder(pos, bs, out=offsets)
    o = 3 * m
    every[o : o + n] = qsl[:-1]
    every[o + n : o + 2 * n] = q
    every[o + 2 * n : o + 3 * n] = seq
    np.take(table.table[:, :nblk], rows, axis=0, out=every[o + 3 * n :].reshape(n, nblk))
    t = torch.from_numpy(every)
    paged = PagedSeqs(
        q_starts=t[o : o + n],
        q_lens=t[o + n : o + 2 * n],
        seq_lens=t[o + 2 * n : o + 3 * n],
        block_tables=t[o + 3 * n :].view(n, nblk),
    )
    meta = AttentionMetadata(
        slot_blocks=t[m : 2 * m],
        slot_offsets=t[2 * m : 3 * m],
        query_start_loc=qsl.tolist(),
        seq_lens=seq.tolist(),
        context_lens=list(ctx_lens),
        num_decodes=num_decodes,
        block_size=bs,
        paged=paged,
        decode_groups=[],
        prefill_block_tables=[],
        cpu_kernels=True,
    )
    return meta, t[:m]
