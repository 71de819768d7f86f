"""Prefix caching: full KV blocks of earlier prompts, found again by their tokens, so that a shared
system prompt or the history of a multi-turn chat is not prefilled twice. The cache holds one
reference on each block it keeps; sequences that reuse a block take their own."""

from __future__ import annotations

from collections import OrderedDict

from ..model.cache import PagedKVCache


class PrefixCache:
    def __init__(self, cache: PagedKVCache, max_blocks: int) -> None:
        self.cache = cache
        self.max_blocks = max_blocks
        # (key of the previous block, this block's tokens) -> block id, least recently used first.
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], int] = OrderedDict()
        self.hits = 0  # blocks reused

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, tokens: list[int]):
        bs, parent = self.cache.block_size, 0
        for i in range(len(tokens) // bs):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            yield key
            parent = hash(key)

    def match(self, tokens: list[int]) -> list[int]:
        """Blocks caching the longest whole-block prefix of `tokens`."""
        found, keys = [], []
        for key in self._keys(tokens):
            block = self._blocks.get(key)
            if block is None:
                break
            keys.append(key)
            found.append(block)
        self._touch(keys)
        self.hits += len(found)
        return found

    def _touch(self, keys: list) -> None:
        """Marks a chain as just used, its first block most recent: eviction takes chain ends first,
        so a cached prefix shortens instead of losing its head (which would orphan the rest)."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def insert(self, tokens: list[int], block_table: list[int]) -> None:
        """Remembers the full blocks holding `tokens` (a prefix of a sequence using `block_table`)."""
        keys = []
        for key, block in zip(self._keys(tokens), block_table):
            keys.append(key)
            if key not in self._blocks:
                self._blocks[key] = block
                self.cache.share([block])
        self._touch(keys)
        self.trim()

    def trim(self) -> None:
        """Evicts down to the size bound, as far as blocks nobody else holds allow (blocks running
        sequences still hold can only go once they are released: call this again then)."""
        while len(self._blocks) > self.max_blocks and self._evict_one():
            pass

    def evict(self, blocks_wanted: int) -> int:
        """Frees least recently used blocks that only this cache still holds -> blocks freed."""
        freed = 0
        while freed < blocks_wanted and self._evict_one():
            freed += 1
        return freed

    def _evict_one(self) -> bool:
        for key, block in self._blocks.items():
            if self.cache.refcount[block] == 1:  # nobody but us
                del self._blocks[key]
                self.cache.release([block])
                return True
        return False

    def clear(self) -> None:
        for block in self._blocks.values():
            self.cache.release([block])
        self._blocks.clear()
