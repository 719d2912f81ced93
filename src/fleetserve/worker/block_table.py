"""The runner's block ids of every request it holds, one numpy row each, kept across steps.

A step's block tables and its tokens' cache slots are then gathered from these rows by
numpy indexing (worker/attn_metadata.py `build_cpu_metadata`) instead of being rebuilt
from Python lists: a decode step changes only the rows that gained a block.

    row r:  [ b0 | b1 | ... | b(n-1) | 0 | 0 ... ]   n = num_blocks[r]; the rest stays 0
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, num_rows: int = 8, num_cols: int = 16) -> None:
        self.table = np.zeros((num_rows, num_cols), dtype=np.int64)
        self.num_blocks = [0] * num_rows  # a list: read per request per step
        self.rows: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))  # popped from the end: lowest first

    def add(self, req_id: str, block_ids: list[int]) -> int:
        """A new request's row (its block ids as given); returns the row."""
        if req_id in self.rows:
            self.remove(req_id)
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self.rows[req_id] = row
        self.num_blocks[row] = 0
        self.extend(req_id, 0, block_ids)
        return row

    def extend(self, req_id: str, num_kept: int, new_ids: list[int]) -> None:
        """Keep the row's first `num_kept` blocks, then append `new_ids`."""
        row = self.rows[req_id]
        held = self.num_blocks[row]
        if num_kept >= held and not new_ids:
            return
        if num_kept < held:
            self.table[row, num_kept:held] = 0
            held = num_kept
        end = held + len(new_ids)
        if end > self.table.shape[1]:
            self._grow_cols(end)
        if new_ids:
            self.table[row, held:end] = new_ids
        self.num_blocks[row] = end

    def remove(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is None:
            return
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free.append(row)

    def _grow_rows(self) -> None:
        n, cols = self.table.shape
        self.table = np.concatenate([self.table, np.zeros((n, cols), dtype=np.int64)])
        self.num_blocks.extend([0] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def _grow_cols(self, want: int) -> None:
        n, cols = self.table.shape
        new_cols = max(want, 2 * cols)
        grown = np.zeros((n, new_cols), dtype=np.int64)
        grown[:, :cols] = self.table
        self.table = grown
