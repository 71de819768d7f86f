"""The lean decoding step: attention read through a view of consecutive blocks must equal the gathered
read, and a query's row must not depend on the other queries of its pass."""

import pytest
import torch

from selfspec.model.attention import gather_kv, paged_attention, sequence_kv, write_kv
from selfspec.model.cache import PagedKVCache


def filled_cache(lengths: list[int], interleave: bool) -> tuple[PagedKVCache, list]:
    """Sequences of `lengths` positions holding random K/V; `interleave` grows them a block at a
    time in turn, so that their block tables are not consecutive."""
    torch.manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=64, block_size=4)
    seqs = [cache.allocate() for _ in lengths]
    step = 4 if interleave else max(lengths)
    while any(s.length < n for s, n in zip(seqs, lengths)):
        for s, n in zip(seqs, lengths):
            if s.length < n:
                cache.prepare([s], [min(step, n - s.length)])
    cache.layers[0].copy_(torch.randn_like(cache.layers[0]))
    return cache, seqs


@pytest.mark.parametrize("interleave", [False, True])
def test_sequence_kv_equals_gather(interleave):
    cache, seqs = filled_cache([13, 22], interleave)
    batch = cache.prepare(seqs, [1, 1])
    assert (batch.first_blocks[0] is None) == interleave
    gathered = gather_kv(cache.layers[0], batch)  # [2, B, kv_heads, T, head_dim]
    for b in range(2):
        t = batch.kv_lens[b]
        assert torch.equal(sequence_kv(cache.layers[0], batch, b), gathered[:, b : b + 1, :, :t])


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_k_query_rows_equal_single_queries(interleave, window):
    cache, (_, seq) = filled_cache([17, 30], interleave)
    q = torch.randn(1, 4, 5, 8)  # [B, heads, S, head_dim]: 4 query heads over 2 kv heads
    new_kv = torch.randn(2, 2, 5, 8)  # [2, kv_heads, S, head_dim]
    batch = cache.prepare([seq], [5])
    assert (batch.first_blocks[0] is None) == interleave
    write_kv(cache.layers[0], new_kv, batch)
    together = paged_attention(q, cache.layers[0], batch, window)
    for j in range(5):
        cache.truncate(seq, 30 + j)
        alone = cache.prepare([seq], [1])
        assert torch.equal(
            paged_attention(q[:, :, j : j + 1], cache.layers[0], alone, window)[:, :, 0], together[:, :, j]
        )


def test_padded_batch_rows_equal_single_sequences():
    cache, seqs = filled_cache([30, 17], interleave=True)
    q = torch.randn(2, 4, 3, 8)
    batch = cache.prepare(seqs, [3, 2])
    out = paged_attention(q, cache.layers[0], batch, None)  # [B, heads, S, head_dim]
    assert torch.equal(out[1, :, 2], torch.zeros(4, 8))  # the padded query row stays finite (zero)
    for b, n in enumerate([3, 2]):
        cache.truncate(seqs[b], seqs[b].length - n)
        alone = cache.prepare([seqs[b]], [n])
        assert torch.equal(paged_attention(q[b : b + 1, :, :n], cache.layers[0], alone, None), out[b : b + 1, :, :n])


@pytest.mark.parametrize("window", [None, 5, 40])
def test_a_prompts_first_chunk_attends_causally(window, monkeypatch):
    """A prompt's chunk with no past takes SDPA's own causal mask (no bool mask built): the same
    attention as the masked call, each query over keys [0, its position] (within a window that covers
    the chunk; a narrower window keeps the mask)."""
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=64, block_size=4)
    seq = cache.allocate()
    batch = cache.prepare([seq], [30])
    batch.exact = False
    write_kv(cache.layers[0], torch.randn(2, 2, 30, 8), batch)
    q = torch.randn(1, 4, 30, 8)
    kv = gather_kv(cache.layers[0], batch)
    masked = torch.nn.functional.scaled_dot_product_attention(
        q, kv[0], kv[1], attn_mask=batch.mask(window), enable_gqa=True
    )
    built, mask = [], type(batch).mask
    monkeypatch.setattr(type(batch), "mask", lambda self, w: built.append(w) or mask(self, w))
    out = paged_attention(q, cache.layers[0], batch, window)
    assert torch.allclose(out, masked, atol=1e-6)
    assert built == ([] if window != 5 else [5])  # the causal call builds no mask
