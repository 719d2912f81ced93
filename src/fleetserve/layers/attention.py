"""Paged attention: write this step's K/V into cache slots, then attend.

The reference backend is plain torch (SDPA), which runs on CPU and GPU alike. Decodes
are attended in one padded batch; prefill chunks one request at a time with a causal
mask offset by the request's cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fleetserve.forward_context import get_forward_context


class Attention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound by the model runner: [num_blocks * block_size, num_kv_heads, head_dim] views.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        meta = get_forward_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None, "KV cache not bound"
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        nd = meta.num_decodes
        # Gather whole blocks (block_size contiguous slots each), not single slots.
        bs = meta.block_size
        k_blocks = k_cache.view(-1, bs, self.num_kv_heads, self.head_dim)
        v_blocks = v_cache.view(-1, bs, self.num_kv_heads, self.head_dim)
        for group in meta.decode_groups:
            rows = slice(group.start, group.end)
            qd = q[rows].unsqueeze(2)  # [rows, num_heads, 1, head_dim]
            shape = (group.end - group.start, -1, self.num_kv_heads, self.head_dim)
            flat = group.block_table.flatten()
            kd = k_blocks.index_select(0, flat).view(shape).transpose(1, 2)  # [rows, kvh, L, hd]
            vd = v_blocks.index_select(0, flat).view(shape).transpose(1, 2)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=group.kv_mask, scale=self.scale, enable_gqa=gqa
            )
            out[rows] = od.squeeze(2)
        qsl = meta.query_start_loc
        for i in range(nd, len(meta.seq_lens)):
            start, end = qsl[i], qsl[i + 1]
            qi = q[start:end].transpose(0, 1)  # [num_heads, q_len, head_dim]
            table = meta.prefill_block_tables[i - nd]
            if table is None:
                # No cached context: the chunk attends only to itself.
                ki = k[start:end].transpose(0, 1)
                vi = v[start:end].transpose(0, 1)
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=gqa
                )
            else:
                ctx, q_len = meta.context_lens[i], end - start
                seq_len = ctx + q_len
                ki = k_blocks.index_select(0, table).view(-1, self.num_kv_heads, self.head_dim)
                vi = v_blocks.index_select(0, table).view(-1, self.num_kv_heads, self.head_dim)
                ki = ki[:seq_len].transpose(0, 1)  # [kv_heads, seq_len, head_dim]
                vi = vi[:seq_len].transpose(0, 1)
                # Query row j sits at position ctx + j and sees keys 0..ctx + j.
                mask = torch.arange(seq_len, device=q.device)[None, :] <= (
                    ctx + torch.arange(q_len, device=q.device)[:, None]
                )
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=gqa
                )
            out[start:end] = oi.transpose(0, 1)
        return out
