"""Attention over the paged KV cache. The reference read path gathers a sequence's blocks and calls
SDPA; it sits behind `paged_attention` so that a fused kernel can replace it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    """Where one forward pass writes its new K/V and what each query may read. Built by
    `PagedKVCache.prepare`; shared by every layer of the pass."""

    positions: torch.Tensor  # [B, S] absolute position of each query token (0 for padding)
    block_tables: torch.Tensor  # [B, max_blocks] cache blocks of each sequence, padded with block 0
    kv_lens: list[int]  # [B] keys visible to sequence b = its last query position + 1
    write_slots: torch.Tensor  # [B * S] slot (block * block_size + offset) receiving each new token's K/V
    block_size: int
    num_tokens: list[int]  # [B] real (unpadded) query tokens per sequence
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, S, T] bool (True = attend), or None when every query may read every gathered key."""
        b, s = self.positions.shape
        t = max(self.kv_lens)
        if b == 1 and s == 1 and (window is None or t <= window):
            return None
        if window not in self._masks:
            keys = torch.arange(t)[None, None, :]  # [1, 1, T]
            pos = self.positions[:, :, None]  # [B, S, 1]
            allowed = keys <= pos
            if window is not None:
                allowed &= keys > pos - window
            self._masks[window] = allowed[:, None]
        return self._masks[window]


def write_kv(layer_kv: torch.Tensor, kv: torch.Tensor, batch: AttentionBatch) -> None:
    """layer_kv [2, kv_heads, blocks, block_size, head_dim] <- kv [2, kv_heads, B * S, head_dim]."""
    two, heads, blocks, bs, dim = layer_kv.shape
    layer_kv.view(two, heads, blocks * bs, dim).index_copy_(2, batch.write_slots, kv)


def gather_kv(layer_kv: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """-> [2, B, kv_heads, T, head_dim], keys of each sequence in position order (T = max kv_len)."""
    two, heads, _, bs, dim = layer_kv.shape
    t = max(batch.kv_lens)
    tables = batch.block_tables  # [B, max_blocks]
    nb = tables.shape[1]
    blocks = layer_kv.index_select(2, tables.flatten())  # [2, kv_heads, B * max_blocks, bs, dim]
    if tables.shape[0] == 1:
        return blocks.view(two, 1, heads, nb * bs, dim)[:, :, :, :t]
    blocks = blocks.view(two, heads, tables.shape[0], nb * bs, dim).transpose(1, 2)
    return blocks[:, :, :, :t]


ROW_EXACT_QUERIES = 64  # up to this many queries in a pass, each is attended on its own (see below)


def paged_attention(q: torch.Tensor, layer_kv: torch.Tensor, batch: AttentionBatch, window: int | None) -> torch.Tensor:
    """q [B, heads, S, head_dim] -> [B, heads, S, head_dim]; keys/values read through the block table.

    A pass of a few queries (decoding, verification, a batch of steps) attends each query on its own,
    over exactly the keys it may see and without a mask: SDPA's inner matmuls round a query's row
    differently when other rows (or masked keys) share the call, and verification must compute each
    position to the same bits as the plain step that would have computed it alone. A long pass (a
    prompt) is one masked call."""
    kv = gather_kv(layer_kv, batch)
    b, _, s, _ = q.shape
    if b * s > ROW_EXACT_QUERIES:
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=batch.mask(window), enable_gqa=True)
    if b * s == 1:  # a plain decoding step: its keys are exactly the gathered ones
        start = 0 if window is None else max(0, batch.kv_lens[0] - window)
        return F.scaled_dot_product_attention(q, kv[0, :, :, start:], kv[1, :, :, start:], enable_gqa=True)
    out = torch.empty_like(q)
    for i in range(b):
        for j in range(batch.num_tokens[i]):
            end = int(batch.positions[i, j]) + 1  # keys [0, position] in a causal pass
            start = 0 if window is None else max(0, end - window)
            k, v = kv[0, i : i + 1, :, start:end], kv[1, i : i + 1, :, start:end]
            qij = q[i : i + 1, :, j : j + 1]
            out[i : i + 1, :, j : j + 1] = F.scaled_dot_product_attention(qij, k, v, enable_gqa=True)
    return out
