import random

import pytest
import torch

from selfspec.errors import CacheFullError
from selfspec.model.cache import NULL_BLOCK, PagedKVCache


def make(num_blocks=9, block_size=4) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size)


def test_append_allocates_blocks_on_demand():
    cache = make()
    seq = cache.allocate()
    cache.prepare([seq], [5])
    assert seq.length == 5 and len(seq.block_table) == 2
    cache.prepare([seq], [3])
    assert seq.length == 8 and len(seq.block_table) == 2
    cache.prepare([seq], [1])
    assert len(seq.block_table) == 3
    assert cache.num_used_blocks == 3 and cache.num_free_blocks == 5
    assert NULL_BLOCK not in seq.block_table


def test_write_positions_follow_block_table():
    cache = make()
    seq = cache.allocate()
    batch = cache.prepare([seq], [6])
    assert batch.positions.tolist() == [[0, 1, 2, 3, 4, 5]]
    expected = [seq.block_table[p // 4] * 4 + p % 4 for p in range(6)]
    assert batch.write_slots.tolist() == expected
    assert batch.kv_lens == [6]


def test_truncate_is_metadata_only():
    cache = make()
    seq = cache.allocate()
    cache.prepare([seq], [10])
    cache.layers[0].fill_(1.0)
    pointers = [layer.data_ptr() for layer in cache.layers]
    table = list(seq.block_table)
    cache.truncate(seq, 5)
    assert seq.length == 5 and seq.block_table == table[:2]
    assert [layer.data_ptr() for layer in cache.layers] == pointers
    assert bool((cache.layers[0] == 1.0).all())  # nothing was cleared or copied
    assert cache.num_free_blocks == 8 - 2
    with pytest.raises(ValueError, match="truncate to 7"):
        cache.truncate(seq, 7)


def test_free_returns_every_block():
    cache = make()
    seqs = [cache.allocate() for _ in range(3)]
    for s in seqs:
        cache.prepare([s], [7])
    assert cache.num_used_blocks == 6
    for s in seqs:
        cache.free(s)
    assert cache.num_used_blocks == 0 and cache.num_free_blocks == 8
    assert all(r == 0 for r in cache.refcount)


def test_exhaustion_raises_clear_error_and_leaves_state_intact():
    cache = make(num_blocks=3, block_size=4)  # 2 usable blocks = 8 tokens
    seq = cache.allocate()
    cache.prepare([seq], [8])
    with pytest.raises(CacheFullError, match="KV cache full"):
        cache.prepare([seq], [1])
    assert seq.length == 8 and len(seq.block_table) == 2
    cache.free(seq)
    assert cache.num_free_blocks == 2


def test_fork_shares_blocks_and_copies_on_write():
    cache = make()
    parent = cache.allocate()
    batch = cache.prepare([parent], [6])
    slots = batch.write_slots
    cache.layers[1][:, :, slots // 4, slots % 4] = torch.arange(6.0)[None, None, :, None]
    child = cache.fork(parent)
    assert child.block_table == parent.block_table
    assert cache.refcount[parent.block_table[0]] == 2 and cache.num_used_blocks == 2
    cache.prepare([child], [1])  # writes position 6 inside the shared second block
    assert child.block_table[0] == parent.block_table[0]  # the full first block stays shared
    assert child.block_table[1] != parent.block_table[1]  # the partial one was copied
    copied = cache.layers[1][0, 0, child.block_table[1], :2, 0]
    assert copied.tolist() == [4.0, 5.0]
    cache.free(parent)
    cache.free(child)
    assert cache.num_used_blocks == 0


def test_random_append_truncate_fork_free_keeps_invariants():
    rng = random.Random(0)
    cache = make(num_blocks=64, block_size=4)
    live = [cache.allocate()]
    for _ in range(3000):
        op = rng.random()
        seq = rng.choice(live)
        try:
            if op < 0.5:
                cache.prepare([seq], [rng.randint(1, 9)])
            elif op < 0.8 and seq.length:
                cache.truncate(seq, rng.randint(0, seq.length))
            elif op < 0.88 and len(live) < 8:
                live.append(cache.fork(seq))
            elif op < 0.95 and len(live) > 1:
                live.remove(seq)
                cache.free(seq)
        except CacheFullError:
            victim = max(live, key=lambda s: s.length)
            cache.truncate(victim, 0)
        for s in live:
            assert len(s.block_table) == cache.blocks_needed(s.length)
        counts = [0] * cache.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        assert counts == cache.refcount  # no leaked and no dangling block
        assert cache.num_free_blocks == sum(1 for b in range(1, cache.num_blocks) if counts[b] == 0)
    for s in live:
        cache.free(s)
    assert cache.num_used_blocks == 0
