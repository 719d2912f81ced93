"""The runner's persistent block table (worker/block_table.py) and the C kernels'
metadata gathered from it: the same tensors, value for value, as the list-built
metadata (worker/attn_metadata.py `build_attention_metadata`); and the numpy
embedding lookup (models/llama.py `embed_rows`) equal to torch's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from fleetserve.models.llama import embed_rows
from fleetserve.worker.attn_metadata import build_attention_metadata, build_cpu_metadata
from fleetserve.worker.block_table import BlockTable


def _row(t: BlockTable, req_id: str) -> list[int]:
    r = t.rows[req_id]
    return t.table[r, : t.num_blocks[r]].tolist()


def test_rows_follow_adds_extends_and_removes() -> None:
    t = BlockTable(num_rows=2, num_cols=2)
    assert t.add("a", [3, 4, 5]) == 0  # wider than the table: its columns grow
    assert t.add("b", [7]) == 1
    assert t.add("c", []) == 2  # a third row: the rows grow
    assert _row(t, "a") == [3, 4, 5] and _row(t, "b") == [7] and _row(t, "c") == []
    t.extend("b", 1, [8, 9])
    t.extend("a", 1, [6])  # blocks given back past the first, then one more
    assert _row(t, "a") == [3, 6] and _row(t, "b") == [7, 8, 9]
    assert t.table[t.rows["a"], 2:].tolist() == [0] * (t.table.shape[1] - 2)
    t.extend("a", 2, [])  # nothing changed
    assert _row(t, "a") == [3, 6]
    t.remove("a")
    assert "a" not in t.rows and not t.table[0].any()
    assert t.add("d", [1]) == 0  # the freed row is taken again
    t.remove("missing")  # forgetting an unknown request is a no-op
    assert t.add("d", [2, 2]) == 0 and _row(t, "d") == [2, 2]  # re-added: a fresh row


def _batch(rng: random.Random, bs: int) -> tuple[list[list[int]], list[int], list[int], int]:
    """Decodes first (q 1, some context), then chunks with or without context and
    verification rows; each request holds blocks for its tokens, some a few more."""
    n_dec, n_rest = rng.randint(0, 6), rng.randint(0, 4)
    if n_dec + n_rest == 0:
        n_dec = 1
    ctx = [rng.randint(1, 90) for _ in range(n_dec)]
    ctx += [rng.choice([0, rng.randint(1, 60)]) for _ in range(n_rest)]
    q = [1] * n_dec + [rng.randint(1, 40) for _ in range(n_rest)]
    ids = list(range(1, 400))
    rng.shuffle(ids)
    tables = []
    for c, n in zip(ctx, q, strict=True):
        need = -(-(c + n) // bs) + rng.randint(0, 2)
        tables.append([ids.pop() for _ in range(need)])
    return tables, ctx, q, n_dec


@pytest.mark.parametrize("seed", range(20))
def test_cpu_metadata_equals_the_list_built_one(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([4, 16])
    tables, ctx, q, nd = _batch(rng, bs)
    t = BlockTable(num_rows=2, num_cols=3)
    t.add("other", [99, 98])  # a row of a request not in this step
    for i, ids in enumerate(tables):
        t.add(f"r{i}", ids[:1])
        t.extend(f"r{i}", 1, ids[1:])
    rows = np.array([t.rows[f"r{i}"] for i in range(len(tables))], dtype=np.int64)
    want, want_pos = build_attention_metadata(
        tables, ctx, q, nd, bs, torch.device("cpu"), cpu_kernels=True
    )
    got, got_pos = build_cpu_metadata(t, rows, ctx, q, nd, bs)
    assert got_pos.tolist() == want_pos.tolist()
    assert got.slot_blocks.tolist() == want.slot_blocks.tolist()
    assert got.slot_offsets.tolist() == want.slot_offsets.tolist()
    for name in ("query_start_loc", "seq_lens", "context_lens", "num_decodes", "block_size"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.paged is not None and want.paged is not None
    for name in ("q_starts", "q_lens", "seq_lens", "block_tables"):
        a, b = getattr(got.paged, name), getattr(want.paged, name)
        assert a.dtype == b.dtype == torch.int64 and a.is_contiguous(), name
        assert a.tolist() == b.tolist(), name
    assert got.cpu_kernels and not got.decode_groups and not got.prefill_block_tables


def test_embed_rows_is_torchs_lookup() -> None:
    emb = nn.Embedding(50, 6)
    with torch.inference_mode():
        ids = torch.tensor([0, 49, 7, 7, 3])
        got = embed_rows(emb, ids)
        assert got.is_contiguous() and torch.equal(got, emb(ids))
        assert embed_rows(emb, ids[:0]).shape == (0, 6)
        with pytest.raises(IndexError):
            embed_rows(emb, torch.tensor([50]))  # torch's own error, as before
        with pytest.raises(IndexError):
            embed_rows(emb, torch.tensor([-1]))
