"""Paged attention: write this step's K/V into cache slots, then attend.

Two backends share this layer. On the CPU in float32, every request of the step
(decodes and prefill chunks alike) is attended in one call by a C kernel that reads K/V
blocks in place (fleetserve/kernels; there the key cache is d-major within a block). The
reference backend is plain torch (SDPA), which runs on CPU and GPU alike: it gathers
each request's blocks and attends decodes in padded groups; prefill chunks without
cached context attend only to themselves through SDPA's causal path.

A layer with a ``sliding_window`` W (Mistral, Gemma's local layers) lets a query at
position p see keys p - W + 1 .. p only, as transformers does; when the engine keeps a
separate block table for such layers (local and global layers in one model), their
metadata is the forward context's ``sliding`` part. ``softcap`` c bounds each scaled
score as c * tanh(s / c).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fleetserve.forward_context import AttentionMetadata, get_forward_context
from fleetserve.kernels import cpu as cpu_kernels


class Attention(torch.nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        # Bound by the model runner: [num_blocks, num_kv_heads, block_size, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        meta = get_forward_context()
        if self.sliding_window is not None and meta.sliding is not None:
            meta = meta.sliding
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None, "KV cache not bound"
        if meta.cpu_kernels:
            # Every sequence (decodes and prefill chunks) in one kernel call, q read in
            # place from the fused qkv output.
            p = meta.paged
            assert p is not None, "the runner builds `paged` whenever cpu_kernels is set"
            cpu_kernels.cache_write(
                k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets
            )  # fmt: skip
            out = torch.empty(q.shape, dtype=q.dtype)
            cpu_kernels.paged_attention(
                q, k_cache, v_cache, out, p.q_starts, p.q_lens, p.seq_lens,
                p.block_tables, meta.block_size, self.scale, self.sliding_window, self.softcap,
            )  # fmt: skip
            return out
        if k_cache.dtype != k.dtype:
            # A cache of another dtype (a bf16 cache under a float32 model): every key and
            # value is attended as stored, the chunk's own ones too (as the C kernel does).
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
            v_cache[meta.slot_blocks, :, meta.slot_offsets] = v
            k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
            v_cache[meta.slot_blocks, :, meta.slot_offsets] = v
        q = q.contiguous()
        out = torch.empty_like(q)
        nd = meta.num_decodes
        self._decodes_torch(meta, q, out)
        qsl = meta.query_start_loc
        for i in range(nd, len(meta.seq_lens)):
            start, end = qsl[i], qsl[i + 1]
            if meta.context_lens[i] == 0 and self.sliding_window is None and not self.softcap:
                # No cached context: the chunk attends only to itself. (4-D inputs:
                # on the CPU, 3-D ones fall to SDPA's slow math path.)
                qi = q[start:end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
                ki = k[start:end].transpose(0, 1)[None]
                vi = v[start:end].transpose(0, 1)[None]
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=self.scale,
                    enable_gqa=self.num_heads != self.num_kv_heads,
                )  # fmt: skip
                out[start:end] = oi[0].transpose(0, 1)
            else:
                self._prefill_torch(meta, i, q, out)
        return out

    # ------------------------------------------------------ plain-torch backend
    def _gather(self, cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks of `table` ([rows, nblk]) as [rows, kv_heads, nblk * block_size, hd], in
        `dtype` (the queries'; a cache of another dtype is widened or narrowed here)."""
        rows, nblk = table.shape
        blocks = cache.index_select(0, table.flatten())  # [rows * nblk, kvh, bs, hd]
        if blocks.dtype != dtype:
            blocks = blocks.to(dtype)
        blocks = blocks.view(rows, nblk, self.num_kv_heads, -1, self.head_dim)
        return blocks.transpose(1, 2).reshape(rows, self.num_kv_heads, -1, self.head_dim)

    def _decodes_torch(self, meta: AttentionMetadata, q: torch.Tensor, out: torch.Tensor) -> None:
        assert self.k_cache is not None and self.v_cache is not None
        group = self.num_heads // self.num_kv_heads
        for g in meta.decode_groups:
            rows = g.end - g.start
            # The query heads sharing a kv head attend as rows of one [group, hd] query.
            qd = q[g.start : g.end].view(rows, self.num_kv_heads, group, self.head_dim)
            kd = self._gather(self.k_cache, g.block_table, q.dtype)
            vd = self._gather(self.v_cache, g.block_table, q.dtype)
            mask = g.kv_mask
            if self.sliding_window is not None:
                lens = mask.sum(-1, keepdim=True)  # [rows, 1, 1, 1]
                keys = torch.arange(mask.shape[-1], device=q.device)
                mask = mask & (keys > lens - 1 - self.sliding_window)
            od = self._sdpa(qd, kd, vd, mask)
            out[g.start : g.end] = od.reshape(rows, self.num_heads, self.head_dim)

    def _prefill_torch(
        self, meta: AttentionMetadata, i: int, q: torch.Tensor, out: torch.Tensor
    ) -> None:
        """A prefill chunk that follows cached context: attend to the gathered blocks."""
        assert self.k_cache is not None and self.v_cache is not None
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        table = meta.prefill_block_tables[i - meta.num_decodes]
        assert table is not None
        ctx, q_len = meta.context_lens[i], end - start
        seq_len = ctx + q_len
        ki = self._gather(self.k_cache, table[None], q.dtype)[0, :, :seq_len]  # [kvh, seq_len, hd]
        vi = self._gather(self.v_cache, table[None], q.dtype)[0, :, :seq_len]
        # Query row j sits at position ctx + j and sees keys 0..ctx + j.
        keys = torch.arange(seq_len, device=q.device)[None, :]
        q_pos = ctx + torch.arange(q_len, device=q.device)[:, None]
        mask = keys <= q_pos
        if self.sliding_window is not None:
            mask = mask & (keys > q_pos - self.sliding_window)
        oi = self._sdpa(q[start:end].transpose(0, 1)[None], ki[None], vi[None], mask)
        out[start:end] = oi[0].transpose(0, 1)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """SDPA over [..., heads, len, hd] with kv heads shared by query heads, or, with
        a softcap (which SDPA has no place for), the same math written out."""
        gqa = self.num_heads != self.num_kv_heads and q.shape[-3] != k.shape[-3]
        if not self.softcap:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
        if gqa:
            rep = q.shape[-3] // k.shape[-3]
            k = k.repeat_interleave(rep, dim=-3)
            v = v.repeat_interleave(rep, dim=-3)
        s = (q @ k.transpose(-1, -2)) * self.scale
        s = self.softcap * torch.tanh(s / self.softcap)
        s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v
