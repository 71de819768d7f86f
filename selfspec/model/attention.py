"""Attention over the paged KV cache. The reference read path gathers a sequence's blocks and calls
SDPA; it sits behind `paged_attention` so that a fused kernel can replace it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.base import EXACT_ROWS


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
    # [B] first block of sequence b when its visible blocks are consecutive in the pool (None otherwise):
    # its keys are then a view of the cache instead of a gathered copy.
    first_blocks: list[int | None] | None = None
    # [B][num_tokens[b]] `positions` as Python ints, so that the per-query loop reads no tensor.
    query_positions: list[list[int]] | None = None
    # False for prompt prefill: its rows need not match a one-query step bit for bit, so the pass is one
    # masked SDPA call however few its queries (about 3x faster than a call per query at long context).
    exact: bool = True
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, S, T] bool (True = attend), or None when every query may read every gathered key."""
        b, s = self.positions.shape
        t = max(self.kv_lens)
        if b == 1 and s == 1 and (window is None or t <= window):
            return None
        if window not in self._masks:
            keys = torch.arange(t, device=self.positions.device)[None, None, :]  # [1, 1, T]
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


def sequence_kv(layer_kv: torch.Tensor, batch: AttentionBatch, b: int) -> torch.Tensor:
    """-> [2, 1, kv_heads, kv_lens[b], head_dim]: sequence b's keys and values in position order; a
    view of the cache when its blocks are consecutive (no copy), else one gather of its blocks."""
    two, heads, blocks, bs, dim = layer_kv.shape
    t = batch.kv_lens[b]
    first = batch.first_blocks[b] if batch.first_blocks is not None else None
    if first is not None:
        flat = layer_kv.view(two, heads, blocks * bs, dim)
        return flat[:, None, :, first * bs : first * bs + t]
    nb = -(-t // bs)
    picked = layer_kv.index_select(2, batch.block_tables[b, :nb])  # [2, kv_heads, nb, bs, dim]
    return picked.view(two, 1, heads, nb * bs, dim)[:, :, :, :t]


def paged_attention(q: torch.Tensor, layer_kv: torch.Tensor, batch: AttentionBatch, window: int | None) -> torch.Tensor:
    """q [B, heads, S, head_dim] -> [B, heads, S, head_dim]; keys/values read through the block table.

    A pass of a few queries (decoding, verification, a batch of steps) attends each query on its own,
    over exactly the keys it may see and without a mask: SDPA's inner matmuls round a query's row
    differently when other rows (or masked keys) share the call, and verification must compute each
    position to the same bits as the plain step that would have computed it alone. A long pass, or a
    prompt's (`batch.exact` False), is one masked call."""
    b, _, s, _ = q.shape
    if b == 1 and s > 1 and not batch.exact and batch.kv_lens[0] == s and (window is None or s <= window):
        # a prompt's first chunk (no past, no padding): SDPA's own causal mask, whose blocks above the
        # diagonal it skips, where a bool mask makes it compute every score
        kv = sequence_kv(layer_kv, batch, 0)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True, enable_gqa=True)
    if b * s > EXACT_ROWS or (s > 1 and not batch.exact):
        kv = gather_kv(layer_kv, batch)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=batch.mask(window), enable_gqa=True)
    if b == 1:
        return _one_sequence(q, sequence_kv(layer_kv, batch, 0), _query_positions(batch, 0), window)
    out = torch.zeros_like(q)  # padded query rows stay zero (finite) for the linears that follow
    for i in range(b):
        n = batch.num_tokens[i]
        if n == 0:
            continue
        rows = _one_sequence(q[i : i + 1, :, :n], sequence_kv(layer_kv, batch, i), _query_positions(batch, i), window)
        out[i : i + 1, :, :n] = rows
    return out


def _query_positions(batch: AttentionBatch, b: int) -> list[int]:
    if batch.query_positions is not None:
        return batch.query_positions[b]
    return batch.positions[b, : batch.num_tokens[b]].tolist()


def _one_sequence(q: torch.Tensor, kv: torch.Tensor, positions: list[int], window: int | None) -> torch.Tensor:
    """q [1, heads, n, head_dim] at `positions` [n], kv [2, 1, kv_heads, T, head_dim] -> [1, heads, n,
    head_dim]: one SDPA call per query over exactly keys [start, position] (row-exact, see above)."""
    k, v = kv[0], kv[1]  # each [1, kv_heads, T, head_dim]
    outs = []
    for qj, pos in zip(q.split(1, dim=2), positions):
        end = pos + 1
        start = 0 if window is None else max(0, end - window)
        if start == 0 and end == k.shape[2]:  # the last query (or a plain step) reads every key
            outs.append(F.scaled_dot_product_attention(qj, k, v, enable_gqa=True))
        else:
            kj, vj = k.narrow(2, start, end - start), v.narrow(2, start, end - start)
            outs.append(F.scaled_dot_product_attention(qj, kj, vj, enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
