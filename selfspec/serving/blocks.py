"""The scheduler's cache manager: the KV blocks a request needs to be admitted (its tokens and its first
round), granted whole or not at all, beside what running requests will take soon; a cached prompt
prefix counts as already held, and cached prefixes nobody uses are evicted to make room."""

from __future__ import annotations

from ..model.cache import PagedKVCache, SequenceKV
from .prefix_cache import PrefixCache


class BlockManager:
    def __init__(self, cache: PagedKVCache, prefix: PrefixCache | None) -> None:
        self.cache = cache
        self.prefix = prefix

    def allocate(self, seq: SequenceKV, prompt: list[int], needed: int, reserved: int) -> bool:
        """Grants an empty sequence room for `needed` blocks, starting it on the cached blocks of its
        prompt's longest cached prefix. `reserved`: blocks running requests will take soon.
        -> True (seq holds the cached prefix; the rest is guaranteed free) or False (nothing changed)."""
        cached = self.prefix.match(prompt) if self.prefix is not None else []
        self.cache.share(cached)  # hold the matched blocks so that eviction below cannot free them
        short = needed - len(cached) - (self.cache.num_free_blocks - reserved)
        if short > 0 and self.prefix is not None:
            short -= self.prefix.evict(short)
        if short > 0:
            self.cache.release(cached)
            return False
        if cached:
            self.cache.adopt(seq, cached)
            self.cache.release(cached)  # the sequence holds its own references now
        return True

    def remember(self, prompt: list[int], seq: SequenceKV) -> None:
        """Keeps the full blocks of a prefilled prompt for later requests that share it."""
        if self.prefix is not None:
            self.prefix.insert(prompt, seq.block_table)
