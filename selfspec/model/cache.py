"""Paged KV cache: a preallocated pool of fixed-size blocks per layer, addressed through per-sequence
block tables. Truncation (speculative rollback) edits metadata only; entries past the new length are
simply overwritten by later writes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..errors import CacheFullError
from .attention import AttentionBatch

NULL_BLOCK = 0  # never handed out: padded query tokens of a batch write here


@dataclass
class SequenceKV:
    """One sequence's view of the cache: which blocks hold its positions, and how many are valid."""

    seq_id: int
    block_table: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is reserved)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)  # the model's: the pool and every attention-metadata tensor live here
        # Per layer [k/v, kv_heads, blocks, block_size, head_dim]: one gather along dim 2 reads k and v.
        # Zero-filled so that padded (masked) keys never carry NaN into attention.
        # In 4 KB pages, unlike the weights (kernels/pages.py): a huge page's first touch, here a request's
        # first writes, took ~0.8 s of compaction for the default pool (a first TTFT 0.89 against 0.07 s).
        self.layers = [
            torch.zeros(2, num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # a stack: pop() hands out low ids first
        self._ids = itertools.count()

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def blocks_needed(self, length: int) -> int:
        return -(-length // self.block_size)

    # ---- sequence lifecycle -----------------------------------------------------------------------
    def allocate(self) -> SequenceKV:
        return SequenceKV(seq_id=next(self._ids))

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A new sequence sharing all of `seq`'s blocks (refcounted); a later write copies only the
        block it writes into, if shared."""
        self.share(seq.block_table)
        return SequenceKV(seq_id=next(self._ids), block_table=list(seq.block_table), length=seq.length)

    def adopt(self, seq: SequenceKV, blocks: list[int]) -> None:
        """Starts an empty sequence on existing full blocks (a cached prefix), sharing them."""
        if seq.block_table:
            raise ValueError("adopt needs an empty sequence")
        self.share(blocks)
        seq.block_table = list(blocks)
        seq.length = len(blocks) * self.block_size

    def share(self, blocks: list[int]) -> None:
        """Takes one more reference on each block (a prefix cache holding it, a fork)."""
        for b in blocks:
            self.refcount[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drops one reference per block; a block nobody references is free again."""
        self._release(blocks)

    def free(self, seq: SequenceKV) -> None:
        self._release(seq.block_table)
        seq.block_table = []
        seq.length = 0

    def truncate(self, seq: SequenceKV, length: int) -> None:
        """Keep positions [0, length): O(1) in the data, only whole blocks past the end are released."""
        if not 0 <= length <= seq.length:
            raise ValueError(f"truncate to {length}: sequence holds {seq.length} positions")
        keep = self.blocks_needed(length)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.length = length

    def growth(self, seq: SequenceKV, start: int, num_tokens: int) -> int:
        """Blocks that making positions [start, start + num_tokens) writable would take from the pool."""
        return max(self.blocks_needed(start + num_tokens) - len(seq.block_table), 0) + len(self._shared(seq, start))

    def _shared(self, seq: SequenceKV, start: int) -> list[int]:
        """Indices of `seq`'s blocks from position `start` on that others share (a write copies them)."""
        table = seq.block_table
        return [i for i in range(start // self.block_size, len(table)) if self.refcount[table[i]] > 1]

    def reserve(self, seq: SequenceKV, start: int, num_tokens: int) -> None:
        """Makes positions [start, start + num_tokens) writable for `seq`, allocating blocks and
        copying a shared block before it is written (copy-on-write)."""
        if start > seq.length:
            raise ValueError(f"write at {start} would leave a gap: sequence holds {seq.length} positions")
        end = start + num_tokens
        new_blocks = self.blocks_needed(end) - len(seq.block_table)
        shared = self._shared(seq, start)
        if new_blocks + len(shared) > len(self._free):
            raise CacheFullError(
                f"KV cache full: {new_blocks + len(shared)} more blocks of {self.block_size} tokens needed, "
                f"{len(self._free)} free of {self.num_blocks - 1}; raise kv_cache_tokens or free sequences"
            )
        for i in shared:
            self._copy_on_write(seq, i)
        for _ in range(max(new_blocks, 0)):
            seq.block_table.append(self._take())
        seq.length = max(seq.length, end)

    # ---- attention metadata -----------------------------------------------------------------------
    def prepare(self, seqs: list[SequenceKV], num_tokens: list[int], starts: list[int] | None = None) -> AttentionBatch:
        """Reserves room for `num_tokens[b]` new positions of sequence b (from its length, or from
        `starts[b]`) and describes the write and the read for one forward pass over them."""
        starts = [s.length for s in seqs] if starts is None else starts
        for seq, start, n in zip(seqs, starts, num_tokens):
            self.reserve(seq, start, n)
        # Built as Python lists and converted once each: a handful of tiny tensor ops per sequence cost
        # more than the whole list arithmetic at decoding sizes (and on a GPU each is one host-to-device copy).
        bs, width = self.block_size, max(num_tokens)
        kv_lens = [start + n for start, n in zip(starts, num_tokens)]
        max_blocks = self.blocks_needed(max(kv_lens))
        positions, slots, tables, firsts = [], [], [], []
        for seq, start, n, kv_len in zip(seqs, starts, num_tokens, kv_lens):
            pos = list(range(start, start + n))
            table = seq.block_table[: self.blocks_needed(kv_len)]
            positions.append(pos)
            slots.append([table[p // bs] * bs + p % bs for p in pos] + [NULL_BLOCK * bs] * (width - n))
            tables.append(table + [NULL_BLOCK] * (max_blocks - len(table)))
            firsts.append(table[0] if table and _consecutive(table) else None)
        dev = self.device
        return AttentionBatch(
            positions=torch.tensor([p + [0] * (width - len(p)) for p in positions], dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),  # [B, max_blocks]
            kv_lens=kv_lens,
            write_slots=torch.tensor(slots, dtype=torch.long, device=dev).flatten(),  # [B * S]
            block_size=bs,
            num_tokens=list(num_tokens),
            first_blocks=firsts,
            query_positions=positions,
        )

    # ---- internals --------------------------------------------------------------------------------
    def _take(self) -> int:
        block = self._free.pop()
        self.refcount[block] = 1
        return block

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def _copy_on_write(self, seq: SequenceKV, index: int) -> None:
        old = seq.block_table[index]
        new = self._take()
        for layer in self.layers:
            layer[:, :, new] = layer[:, :, old]
        self.refcount[old] -= 1
        seq.block_table[index] = new


def _consecutive(table: list[int]) -> bool:
    return all(b - a == 1 for a, b in zip(table, table[1:]))
