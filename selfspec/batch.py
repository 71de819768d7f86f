"""Offline batched decoding for calibration and statistical checks: many sequences advance together
through plain or speculative rounds (the scheduler for serving lives elsewhere)."""

from __future__ import annotations

import torch

from .kv_cache import PagedKVCache, SequenceKV
from .model import DecoderModel
from .sampling import SamplingParams
from .speculative import SpecConfig, plain_round, speculative_round


def prefill(model: DecoderModel, cache: PagedKVCache, seq: SequenceKV, tokens: list[int], chunk: int = 512) -> None:
    """Appends `tokens` to `seq`'s cache through all layers (no logits)."""
    for i in range(0, len(tokens), chunk):
        part = tokens[i : i + chunk]
        batch = cache.prepare([seq], [len(part)])
        model.run_layers(model.embed(torch.tensor([part])), 0, model.num_layers, batch, cache)


@torch.inference_mode()
def generate_batch(
    model: DecoderModel,
    cache: PagedKVCache,
    seqs: list[SequenceKV],
    last: list[int],
    params: SamplingParams,
    spec: SpecConfig | None,
    generators: list[torch.Generator | None],
    new_tokens: int,
    draft_logits=None,
) -> list[list[int]]:
    """Advances every sequence (its cache holding all but `last[b]`) until each has new_tokens more
    tokens; EOS is not special. Rows that finish early keep running with the rest."""
    rows = len(seqs)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    while min(len(t) for t in tokens) < new_tokens:
        inputs = [t[-1] if t else last[b] for b, t in enumerate(tokens)]
        if spec is None:
            result = plain_round(model, cache, seqs, inputs, [params] * rows, generators)
        else:
            result = speculative_round(model, cache, seqs, inputs, spec, [params] * rows, generators, draft_logits=draft_logits)
        for t, new in zip(tokens, result.tokens):
            t += new
    return [t[:new_tokens] for t in tokens]
